"""Fenced ```json / ```sql segment constraints accept the body plus the closing fence."""

from __future__ import annotations

import pytest

from evals.structured.driver import decode, random_logits
from gateway.structured.build import build_constraint
from gateway.structured.cache import ConstraintCache
from gateway.structured.segment import FENCE_CLOSE, segment_body, segment_spec
from gateway.structured.sql_schema import DatabaseSchema
from gateway.structured.validate import validate_json

DB = DatabaseSchema.from_mapping({"trades": ["id", "symbol", "qty"]})


def _run(spec, tokinfo, text: str):
    c = build_constraint(spec, tokinfo, cache=ConstraintCache())
    ok = all(c.consume(t) for t in tokinfo.encode(text))
    return ok, c


def test_json_segment_closes_with_fence(tokinfo):
    schema = {"type": "object", "properties": {"qty": {"type": "integer"}}, "required": ["qty"]}
    spec = segment_spec("json", schema)
    ok, c = _run(spec, tokinfo, '{"qty": 3}' + FENCE_CLOSE)
    assert ok and c.is_accepting() and c.is_terminated()
    ok, c = _run(spec, tokinfo, '{"qty": 3}')
    assert ok and not c.is_accepting()  # the fence must still close
    out = decode(build_constraint(spec, tokinfo, max_tokens=128, cache=ConstraintCache()),
                 random_logits(tokinfo.vocab_size, 0), 128)
    assert out.finished
    validate_json(segment_body(tokinfo.decode(out.ids[:-1])), schema)


def test_sql_segment(tokinfo):
    spec = segment_spec("sql", db_schema=DB)
    ok, c = _run(spec, tokinfo, "SELECT symbol FROM trades WHERE qty > 5" + FENCE_CLOSE)
    assert ok and c.is_accepting()
    ok, _ = _run(spec, tokinfo, "SELECT secret FROM trades" + FENCE_CLOSE)
    assert not ok


def test_unknown_fence_language():
    with pytest.raises(ValueError):
        segment_spec("python")
