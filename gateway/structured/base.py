"""Constraint interfaces (spec, compiled constraint, matcher, backend) and the backend registry."""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import StrEnum

from .vocab import TokenizerInfo


class ConstraintKind(StrEnum):
    JSON_SCHEMA = "json_schema"  # source: the schema as JSON text
    REGEX = "regex"  # source: a regular expression (whole output must match)
    GRAMMAR = "grammar"  # source: a Lark grammar (llguidance dialect)
    TOOL_CALLS = "tool_calls"  # source: a Lark grammar built by tools.py
    SQL = "sql"  # source: a Lark grammar built by sql_grammar.py


@dataclass(frozen=True)
class ConstraintSpec:
    """What to constrain to; `source` is canonical text (its hash is the cache key)."""

    kind: ConstraintKind
    source: str
    # TOOL_CALLS: ids of the tokens right before a JSON part (the finite-number guard restarts there);
    # None: the format's arguments are not one JSON text (no guard)
    json_starts: tuple[int, ...] | None = ()
    # JSON_SCHEMA: Lark rules around the JSON value, which `@json_schema` marks (a family whose turn wraps it,
    # ToolFormat.json_envelope); "" when the value is the whole output
    envelope: str = ""

    @property
    def digest(self) -> str:
        return hashlib.sha256(f"{self.kind}\0{self.source}\0{self.envelope}".encode()).hexdigest()[:24]


class Matcher(ABC):
    """Per-sequence automaton state: consumes sampled ids, writes the allowed-token bitmask."""

    @abstractmethod
    def consume(self, token_id: int) -> bool:
        """Advance by one sampled id; False (and error state) if the id was not allowed."""

    @abstractmethod
    def fill_bitmask(self, row_ptr: int, n_words: int) -> None:
        """Write the allowed ids (bit i of word i//32) into n_words int32 at row_ptr."""

    @abstractmethod
    def is_accepting(self) -> bool:
        """The output so far is a complete match (EOS may be emitted)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """No further non-EOS token can extend the match (or the matcher has ended)."""

    def error(self) -> str:
        return ""

    def allows(self, token_id: int) -> bool | None:
        """Whether the mask would allow `token_id` now (nothing consumed, the same answer as `fill_bitmask`'s bit);
        None where only the mask tells."""
        return None

    def forces(self) -> bool | None:
        """Whether the grammar forces the next bytes now; None where only the mask tells."""
        return None

    def forced_token(self) -> int | None:
        """The id the mask allows alone where the grammar forces bytes that start with a whole token; None where it
        does not, or only the mask tells."""
        return None

    # The native llguidance.LLMatcher when the backend is llguidance (parallel batched masks).
    llg = None


class CompiledConstraint(ABC):
    """A compiled, immutable, cacheable constraint; spawns one Matcher per sequence."""

    backend: str
    spec: ConstraintSpec
    tokenizer: TokenizerInfo

    @abstractmethod
    def new_matcher(self) -> Matcher: ...


class Backend(ABC):
    """A constraint compiler (outlines-core, llguidance, ...)."""

    name: str
    kinds: frozenset[ConstraintKind]

    @abstractmethod
    def compile(self, spec: ConstraintSpec, tokenizer: TokenizerInfo) -> CompiledConstraint:
        """Compile or raise a typed StructuredOutputError (never drop a feature silently)."""
