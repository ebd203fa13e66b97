"""llguidance backend: JSON Schema, regex and Lark CFGs (Earley parser + lexer over the token trie)."""

from __future__ import annotations

import re

import llguidance

from .base import Backend, CompiledConstraint, ConstraintKind, ConstraintSpec, Matcher, register_backend
from .errors import ConstraintCompileError, UnsupportedSchemaError
from .json_schema import llguidance_json_grammar, parse_schema
from .vocab import TokenizerInfo

# Lexer budgets above llguidance's defaults (fuel 1M initial / 200k per step, 250k lexer states):
# patterns like `^(?:\S+\s+){0,99}\S+$` under minLength/maxLength exhaust the defaults mid-string
# ("too many expressions constructed", a dead end at runtime); fuel still bounds each mask.
PARSER_LIMITS = dict(initial_lexer_fuel=20_000_000, step_lexer_fuel=5_000_000, max_lexer_states=2_000_000)


class LLGuidanceMatcher(Matcher):
    def __init__(self, native: llguidance.LLMatcher, n_words: int) -> None:
        self.llg = native
        self._n_words = n_words  # words llguidance writes: ceil(tokenizer vocab / 32)

    def consume(self, token_id: int) -> bool:
        return self.llg.consume_token(token_id)

    def fill_bitmask(self, row_ptr: int, n_words: int) -> None:
        if n_words < self._n_words:
            raise ValueError(f"bitmask row has {n_words} words, the vocabulary needs {self._n_words}")
        self.llg.unsafe_compute_mask_ptr(row_ptr, self._n_words * 4)

    def is_accepting(self) -> bool:
        return self.llg.is_accepting()

    def is_terminated(self) -> bool:
        return self.llg.is_stopped()

    def error(self) -> str:
        return self.llg.get_error()


class LLGuidanceCompiled(CompiledConstraint):
    backend = "llguidance"

    def __init__(self, spec: ConstraintSpec, tokenizer: TokenizerInfo, grammar: str) -> None:
        self.spec, self.tokenizer, self.grammar = spec, tokenizer, grammar
        self._template = llguidance.LLMatcher(tokenizer.llg, grammar, log_level=0,
                                              limits=llguidance.LLParserLimits(**PARSER_LIMITS))
        if self._template.is_error():
            raise _typed_error(spec.kind, self._template.get_error())
        self._n_words = (tokenizer.vocab_size + 31) // 32

    def new_matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._template.deep_copy(), self._n_words)


_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[(.*?)\]")


def _typed_error(kind: ConstraintKind, message: str) -> Exception:
    """Map llguidance's compile messages onto typed errors a caller can act on."""
    if m := _UNIMPLEMENTED.search(message):
        keys = [k.strip().strip('"') for k in m.group(1).split(",")]
        return UnsupportedSchemaError(keys[0], "#", f"unimplemented: {', '.join(keys)}", "llguidance")
    if "Unknown format" in message:
        return UnsupportedSchemaError("format", "#", message.strip(), "llguidance")
    if "oneOf constraints are not supported" in message:
        return UnsupportedSchemaError("oneOf", "#", "branches may overlap; use anyOf", "llguidance")
    return ConstraintCompileError(kind, message.strip().splitlines()[0][:500] if message.strip() else "unknown error")


class LLGuidanceBackend(Backend):
    name = "llguidance"
    kinds = frozenset(ConstraintKind)

    def grammar_for(self, spec: ConstraintSpec) -> str:
        if spec.kind is ConstraintKind.JSON_SCHEMA:
            return llguidance_json_grammar(parse_schema(spec.source))
        if spec.kind is ConstraintKind.REGEX:
            return llguidance.LLMatcher.grammar_from_regex(spec.source)
        return llguidance.LLMatcher.grammar_from_lark(spec.source)

    def compile(self, spec: ConstraintSpec, tokenizer: TokenizerInfo) -> LLGuidanceCompiled:
        try:
            grammar = self.grammar_for(spec)
        except ValueError as e:
            raise ConstraintCompileError(spec.kind, str(e)) from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer.llg)
        if is_error:
            raise _typed_error(spec.kind, messages[0] if messages else "invalid grammar")
        return LLGuidanceCompiled(spec, tokenizer, grammar)


register_backend(LLGuidanceBackend())

__all__ = ["LLGuidanceBackend", "LLGuidanceCompiled", "LLGuidanceMatcher"]
