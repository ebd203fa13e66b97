"""Entry points the gateway calls: specs for each request kind, and the per-sequence Constraint."""

from __future__ import annotations

import json
from collections.abc import Sequence

from .base import ConstraintKind, ConstraintSpec
from .batch import BatchMasker
from .cache import ConstraintCache, default_cache
from .constraint import Constraint
from .json_schema import parse_schema
from .vocab import TokenizerInfo


def json_schema_spec(schema: str | dict | bool, envelope: str = "", json_starts: tuple[int, ...] = ()
                     ) -> ConstraintSpec:
    """response_format json_schema (or json_object with {"type": "object"}); `envelope`: the family's rules
    around the value (ToolFormat.json_envelope), `json_starts` the tokens right before it there."""
    return ConstraintSpec(ConstraintKind.JSON_SCHEMA, json.dumps(parse_schema(schema)), json_starts=json_starts,
                          envelope=envelope)


def regex_spec(pattern: str) -> ConstraintSpec:
    return ConstraintSpec(ConstraintKind.REGEX, pattern)


def build_constraint(
    spec: ConstraintSpec,
    tokenizer: TokenizerInfo,
    *,
    eos_ids: Sequence[int] | None = None,
    max_tokens: int | None = None,
    backend: str | None = None,
    cache: ConstraintCache | None = None,
    closing_window: int | None = None,
    mask_batcher: BatchMasker | None = None,
) -> Constraint:
    """Compile (or fetch from the LRU) and bind to one sequence. Raises typed errors (HTTP 400).
    With `mask_batcher` (the gateway passes batch.default_masker()) the engine masks all constrained
    rows of a step in one call (and prefetches them during the forward pass on CUDA); without one
    the constraint is a plain per-row logits processor."""
    compiled = (cache if cache is not None else default_cache()).get_or_compile(spec, tokenizer, backend)
    if closing_window is None:  # the last quarter of the budget (at least 32 steps) closes the output
        closing_window = max(32, (max_tokens or 0) // 4)
    return Constraint(compiled, eos_ids=eos_ids, max_tokens=max_tokens, closing_window=closing_window,
                      mask_batcher=mask_batcher)
