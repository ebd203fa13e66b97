"""A "competent model" proxy for constrained decoding: the reference model's logits plus a large boost on the
gold next token (teacher-forced: the token of a gold output at the position the sequence has reached), which
is how a trained model's distribution looks near the valid set. Gold outputs: Spider's gold queries per
database (SQL) and a valid instance built from each JSON Schema (`instance`), each kept only where the
constraint itself accepts it token by token."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import torch

STRINGS = {"date-time": "2024-05-01T09:30:00Z", "date": "2024-05-01", "time": "09:30:00", "email": "ops@example.com",
           "uri": "https://example.com/a", "uuid": "123e4567-e89b-12d3-a456-426614174000"}


def instance(schema: dict | bool, depth: int = 0):
    """A plain instance of `schema` (every property, one array item, the first enum value); may be invalid for
    schemas this does not read (combinators, patterns): the caller checks it against the constraint."""
    if not isinstance(schema, dict) or depth > 6:
        return {}
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if schema.get(key):
            return instance(schema[key][0], depth + 1)
    kind = schema.get("type", "object" if "properties" in schema else "string")
    kind = kind[0] if isinstance(kind, list) else kind
    if kind == "object":
        return {k: instance(v, depth + 1) for k, v in schema.get("properties", {}).items()}
    if kind == "array":
        return [instance(schema.get("items", {}), depth + 1)] * max(1, schema.get("minItems", 1))
    if kind == "integer":
        return max(1, int(schema.get("minimum", 1)))
    if kind == "number":
        return max(1.5, float(schema.get("minimum", 1.5)))
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    return STRINGS.get(schema.get("format", ""), "AAPL")


def accepted_ids(constraint, tokenizer, texts: list[str]) -> list[int] | None:
    """The token ids (EOS last) of the first of `texts` that `constraint`'s grammar and guard accept whole."""
    for text in texts:
        ids = tokenizer.encode(text)
        probe = constraint.compiled.new_matcher()
        guard_ok = constraint.guard is None or constraint.guard.allows(ids, final=True)
        if guard_ok and all(probe.consume(t) for t in ids) and probe.is_accepting():
            return [*ids, constraint.eos_ids[0]]
    return None


def json_texts(schema: dict) -> list[str]:
    value = instance(schema)
    return [json.dumps(value, separators=(",", ":")), json.dumps(value), json.dumps(value, indent=2)]


def spider_gold(dev: list[dict]) -> dict[str, list[str]]:
    """Spider's gold queries by database id."""
    out: dict[str, list[str]] = {}
    for ex in dev:
        out.setdefault(ex["db_id"], []).append(ex["query"])
    return out


@contextlib.contextmanager
def boosted(gold: dict[str, list[int]], boost: float) -> Iterator[None]:
    """While open, the engine's sampler sees each sequence with a gold output (by request id) with `boost`
    added to the logit of its gold next token."""
    import engine.multi_token as multi_token

    original = multi_token.sample

    def sample(rows, seqs, vocab_limit=None, first_max=None, view=None):
        moved = False  # (first_max, the lm_head's pick of each row, is stale once a row is boosted)
        with torch.inference_mode():  # (the forward's logits are inference tensors; the step runs outside the mode)
            for row, seq in zip(rows, seqs, strict=True):
                ids = gold.get(seq.request_id)
                if ids is not None and len(seq.output_token_ids) < len(ids):
                    row[ids[len(seq.output_token_ids)]] += boost
                    moved = True
        return original(rows, seqs, vocab_limit, None if moved else first_max, view)  # (view: the same memory)

    multi_token.sample = sample
    try:
        yield
    finally:
        multi_token.sample = original
