"""llguidance backend: JSON Schema, regex and Lark CFGs (Earley parser + lexer over the token trie)."""

from __future__ import annotations

import json
import re

import llguidance

from .base import Backend, CompiledConstraint, ConstraintKind, ConstraintSpec, Matcher
from .errors import ConstraintCompileError, UnsupportedSchemaError
from .json_enforce import (
    GUIDED,
    NUMERIC_BOUNDS,
    VALIDATION,
    Enforcement,
    grammar_schema,
    meta_validate,
    resolve_pointer,
)
from .json_schema import STRICT_JSON_OPTIONS, parse_schema, walk
from .vocab import TokenizerInfo

# Lexer budgets above llguidance's defaults (fuel 1M initial / 200k per step, 250k lexer states):
# patterns like `^(?:\S+\s+){0,99}\S+$` under minLength/maxLength exhaust the defaults mid-string
# ("too many expressions constructed", a dead end at runtime); fuel still bounds each mask.
PARSER_LIMITS = dict(initial_lexer_fuel=20_000_000, step_lexer_fuel=5_000_000, max_lexer_states=2_000_000)
# SQL: any name after a qualifier (a CTE's or derived table's column) completes an operand at every byte
# of every identifier token after `q.`: up to ~3x llguidance's default 50,000 Earley items per mask there
_KIND_LIMITS = {ConstraintKind.SQL: dict(step_max_items=150_000)}


class LLGuidanceMatcher(Matcher):
    def __init__(self, native: llguidance.LLMatcher, n_words: int) -> None:
        self.llg = native
        self._n_words = n_words  # words llguidance writes: ceil(tokenizer vocab / 32)
        # this state's forced tokens (compute_ff_tokens, ~20-60 us a call) and forced bytes once asked: the lazy
        # checks ask for each candidate and jump-forward twice per token, all in one state; a consumed token starts
        # a new one
        self._forced: list[int] | None = None
        self._forces: bool | None = None

    def consume(self, token_id: int) -> bool:
        self._forced = self._forces = None
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

    def allows(self, token_id: int) -> bool | None:
        # forced bytes: llguidance's mask is then the first of their canonical tokens alone ("symbol" after `{"`),
        # where validate_tokens takes any token that starts them ("sy" as well); where they tokenize to no whole
        # token (a tail the next token must start with) the full row says which
        if self.forces():
            forced = self.forced_token()
            return token_id == forced if forced is not None else None
        return self.llg.validate_tokens([token_id]) == 1

    def forces(self) -> bool:
        if self._forces is None:
            self._forces = bool(self._forced) or bool(self.llg.compute_ff_bytes())  # (forced tokens are forced bytes)
        return self._forces

    def forced_token(self) -> int | None:
        if self._forced is None:  # no forced bytes: no forced token, without llguidance's tokenizing search
            self._forced = self.llg.compute_ff_tokens() if self.forces() else []
        return self._forced[0] if self._forced else None


class LLGuidanceCompiled(CompiledConstraint):
    backend = "llguidance"

    def __init__(self, spec: ConstraintSpec, tokenizer: TokenizerInfo, grammar: str,
                 enforcement: Enforcement | None = None) -> None:
        self.spec, self.tokenizer, self.grammar = spec, tokenizer, grammar
        self.enforcement = enforcement  # JSON Schema: how each keyword is enforced
        self._template = llguidance.LLMatcher(tokenizer.llg, grammar, log_level=0,
                                              limits=llguidance.LLParserLimits(
                                                  **PARSER_LIMITS, **_KIND_LIMITS.get(spec.kind, {})))
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


def _check(grammar: str, tokenizer: TokenizerInfo) -> tuple[str | None, list[str]]:
    """(first error or None, warnings) of a grammar against the tokenizer."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer.llg)
    return (messages[0] if messages else "invalid grammar") if is_error else None, [] if is_error else messages


def enveloped(json_grammar: str, envelope: str) -> str:
    """A JSON Schema grammar (llguidance's top-level JSON) inside `envelope`, Lark rules naming it `@json_schema`."""
    top = json.loads(json_grammar)
    value = {**top["grammars"][0], "name": "json_schema"}
    return json.dumps({**top, "grammars": [{"name": "envelope", "lark_grammar": envelope}, value]})


def _json_grammar(schema: dict | bool, options: dict) -> str:
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
    except ValueError as e:
        raise ConstraintCompileError("json_schema", str(e)) from None


def _drop_where_rejected(schema: dict, keys: tuple[str, ...], probe, tokenizer: TokenizerInfo,
                         report: Enforcement) -> bool:
    """Remove `keys` from each sub-schema whose probe (a small schema with just those keys) llguidance
    rejects; they are then checked by validation. Returns whether anything was removed."""
    removed = False
    for _, sub in walk(schema):
        part = {k: sub[k] for k in keys if k in sub}
        if not part:
            continue
        error, _ = _check(_json_grammar(probe(sub, part), STRICT_JSON_OPTIONS), tokenizer)
        if error is not None:
            for k in part:
                sub.pop(k)
                report.set(k, VALIDATION)
            removed = True
    return removed


def _number_probe(sub: dict, part: dict) -> dict:
    types = sub.get("type", "number")
    return {"type": [t for t in ([types] if isinstance(types, str) else types) if t in ("number", "integer")]
            or "number", **part}


def _strip_ref_siblings(schema: dict, report: Enforcement) -> bool:
    removed = False
    for _, sub in walk(schema):
        if "$ref" in sub:
            for k in [k for k in sub if k in _ASSERTING]:
                sub.pop(k)
                report.set(k, VALIDATION)
                removed = True
    if removed:
        report.note("keywords beside a recursive $ref are checked by validation (llguidance cannot intersect them)")
    return removed


_ASSERTING = frozenset({"type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
                        "minLength", "maxLength", "pattern", "minimum", "maximum", "enum", "const", "anyOf", "allOf",
                        "oneOf", "minProperties", "maxProperties", "patternProperties", "exclusiveMinimum",
                        "exclusiveMaximum", "multipleOf", "prefixItems", "additionalItems", "format"})


def compile_json_schema(source: str, tokenizer: TokenizerInfo) -> tuple[str, Enforcement]:
    """The grammar of a JSON Schema and its enforcement report. Strict llguidance options first; each
    failure llguidance reports relaxes the grammar (never the validation) by one step: oneOf as anyOf,
    numeric bounds or patterns it cannot express, keywords beside a recursive $ref, then lenient mode.
    A schema that is invalid, unresolvable or unsatisfiable is a typed 400."""
    derived = grammar_schema(meta_validate(parse_schema(source)))
    schema, report, options = derived.schema, derived.enforcement, dict(STRICT_JSON_OPTIONS)
    tried: set[str] = set()
    relaxed: set[str] = set()
    while True:
        grammar = _json_grammar(schema, options)
        error, warnings = _check(grammar, tokenizer)
        if error is None:
            for w in warnings:
                report.note(f"llguidance: {w.strip()[:200]}")
            return grammar, report
        if "nsatisfiable" in error:
            raise ConstraintCompileError("json_schema", f"the schema admits no value: {error.strip()[:300]}")
        step = _relaxation(error, tried)
        if step is None:
            raise _typed_error(ConstraintKind.JSON_SCHEMA, error)
        if step == "lenient" and _relax_subschema(schema, error, relaxed, report):
            continue  # the part llguidance named is left to validation; the rest stays strict
        tried.add(step)
        if step == "oneOf":
            options["coerce_one_of"] = True
            report.set("oneOf", GUIDED)
            report.note("oneOf branches may overlap: the grammar admits any branch, validation checks exactly one")
        elif step == "numbers":
            _drop_where_rejected(schema, NUMERIC_BOUNDS, _number_probe, tokenizer, report)
        elif step == "pattern":
            _drop_where_rejected(schema, ("pattern",), lambda sub, part: {"type": "string", **part}, tokenizer, report)
        elif step == "ref_siblings":
            _strip_ref_siblings(schema, report)
        else:
            options["lenient"] = True
            report.note(f"llguidance lenient mode (unsupported parts are checked by validation): {error.strip()[:200]}")
            for key in _unimplemented(error):
                report.set(key, VALIDATION)
            for key in report.rewritten:  # lenient mode may have dropped part of a rewrite
                report.set(key, GUIDED)


_LOCATION = re.compile(r"while processing (\S*?)(#/[^\s\"']*)|(json-schema://[^#\s]*)(#/[^\s\"']*)")
MAX_RELAXED_SUBSCHEMAS = 8


def _relax_subschema(schema: dict | bool, error: str, relaxed: set[str], report: Enforcement) -> bool:
    """Replace the sub-schema llguidance's error names (`while processing json-schema:///#/...`) by
    `{}` in the grammar's schema: validation alone checks it. False when none is named (or too many were)."""
    m = _LOCATION.search(error)
    if m is None or len(relaxed) >= MAX_RELAXED_SUBSCHEMAS or not isinstance(schema, dict):
        return False
    base, pointer = (m.group(1), m.group(2)) if m.group(2) else (m.group(3), m.group(4))
    if base not in ("json-schema:///", schema.get("$id"), schema.get("id")) or pointer in relaxed:
        return False  # a location in another document: not this schema's pointer
    target = resolve_pointer(schema, pointer)
    if target is None or target is schema:
        return False
    target.clear()
    relaxed.add(pointer)
    report.set(f"subschema:{pointer}", VALIDATION)
    report.note(f"llguidance cannot compile {pointer} ({error.strip().splitlines()[0][:160]}): validation checks it")
    return True


def _relaxation(error: str, tried: set[str]) -> str | None:
    for step, needle in (("oneOf", "oneOf constraints are not supported"), ("numbers", " range"),
                         ("pattern", "regex"), ("ref_siblings", "circular references with sibling keys"),
                         ("lenient", "")):
        if step not in tried and needle in error:
            return step
    return None


def _unimplemented(message: str) -> list[str]:
    m = _UNIMPLEMENTED.search(message)
    return [k.strip().strip('"') for k in m.group(1).split(",")] if m else []


class LLGuidanceBackend(Backend):
    name = "llguidance"
    kinds = frozenset(ConstraintKind)

    def grammar_for(self, spec: ConstraintSpec) -> str:
        if spec.kind is ConstraintKind.REGEX:
            return llguidance.LLMatcher.grammar_from_regex(spec.source)
        return llguidance.LLMatcher.grammar_from_lark(spec.source)

    def compile(self, spec: ConstraintSpec, tokenizer: TokenizerInfo) -> LLGuidanceCompiled:
        if spec.kind is ConstraintKind.JSON_SCHEMA:
            grammar, report = compile_json_schema(spec.source, tokenizer)
            if spec.envelope:
                grammar = enveloped(grammar, spec.envelope)
                if (error := _check(grammar, tokenizer)[0]) is not None:
                    raise _typed_error(spec.kind, error)
            return LLGuidanceCompiled(spec, tokenizer, grammar, report)
        try:
            grammar = self.grammar_for(spec)
        except ValueError as e:
            raise ConstraintCompileError(spec.kind, str(e)) from None
        # (the template matcher's construction checks the grammar and raises the same typed error: a
        # separate validate_grammar_with_warnings call compiled every grammar twice)
        return LLGuidanceCompiled(spec, tokenizer, grammar)



__all__ = ["LLGuidanceBackend", "LLGuidanceCompiled", "LLGuidanceMatcher"]
