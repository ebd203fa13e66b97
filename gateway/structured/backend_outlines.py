"""outlines-core backend: regex and JSON Schema compiled to a token-level DFA index."""

from __future__ import annotations

import outlines_core

from .base import Backend, CompiledConstraint, ConstraintKind, ConstraintSpec, Matcher
from .errors import ConstraintCompileError
from .json_schema import outlines_json_regex, parse_schema
from .vocab import TokenizerInfo


class OutlinesMatcher(Matcher):
    def __init__(self, guide: outlines_core.Guide, eos_id: int, n_words: int, only_eos: dict[int, bool]) -> None:
        self.guide, self._eos, self._n_words = guide, eos_id, n_words
        self._only_eos = only_eos  # DFA state -> "only EOS allowed", shared by the compiled index
        self._failed = ""
        self._ended = False

    def consume(self, token_id: int) -> bool:
        if self._failed or self._ended:
            return False
        if not self.guide.accepts_tokens([token_id]):
            self._failed = f"token {token_id} not allowed"
            return False
        self.guide.advance(token_id, return_tokens=False)
        self._ended = token_id == self._eos
        return True

    def fill_bitmask(self, row_ptr: int, n_words: int) -> None:
        if n_words < self._n_words:
            raise ValueError(f"bitmask row has {n_words} words, the vocabulary needs {self._n_words}")
        self.guide.write_mask_into(row_ptr, self._n_words, 4)

    def is_accepting(self) -> bool:
        return self.guide.is_finished()

    def is_terminated(self) -> bool:
        if self._ended or self._failed:
            return True
        state = self.guide.get_state()
        if state not in self._only_eos:  # get_tokens() lists every allowed id: once per state
            self._only_eos[state] = self.guide.is_finished() and set(self.guide.get_tokens()) <= {self._eos}
        return self._only_eos[state]

    def error(self) -> str:
        return self._failed


class OutlinesCompiled(CompiledConstraint):
    backend = "outlines-core"

    def __init__(self, spec: ConstraintSpec, tokenizer: TokenizerInfo, regex: str) -> None:
        self.spec, self.tokenizer, self.regex = spec, tokenizer, regex
        try:
            self.index = outlines_core.Index(regex, tokenizer.outlines_vocabulary)
        except Exception as e:  # invalid regex or a regex no token sequence can match
            raise ConstraintCompileError(spec.kind, f"outlines-core: {e}") from None
        self._n_words = (tokenizer.vocab_size + 31) // 32
        self._only_eos: dict[int, bool] = {}

    def new_matcher(self) -> OutlinesMatcher:
        guide = outlines_core.Guide(self.index)
        return OutlinesMatcher(guide, self.tokenizer.eos_ids[0], self._n_words, self._only_eos)


class OutlinesBackend(Backend):
    name = "outlines-core"
    kinds = frozenset({ConstraintKind.JSON_SCHEMA, ConstraintKind.REGEX})

    def compile(self, spec: ConstraintSpec, tokenizer: TokenizerInfo) -> OutlinesCompiled:
        if spec.envelope:
            raise ConstraintCompileError(spec.kind, "outlines-core compiles a JSON value alone, not inside a "
                                         "family's envelope (harmony's final channel): use the llguidance backend")
        if spec.kind is ConstraintKind.JSON_SCHEMA:
            regex = outlines_json_regex(parse_schema(spec.source))
        else:
            regex = spec.source
        return OutlinesCompiled(spec, tokenizer, regex)


