"""Tool calls in Qwen syntax under tool_choice none/auto/required/named, parsed and validated."""

from __future__ import annotations

import pytest
import torch

from evals.structured.driver import decode, random_logits
from gateway.structured.build import build_constraint
from gateway.structured.cache import ConstraintCache
from gateway.structured.errors import ConstraintCompileError, StructuredValidationError, ToolCallParseError
from gateway.structured.tools import parse_tool_calls, text_before_tool_calls, tool_call_spec
from gateway.structured.validate import validate_tool_calls

TOOLS = [
    {"type": "function", "function": {"name": "get_quote", "parameters": {
        "type": "object", "properties": {"symbol": {"type": "string", "maxLength": 5}},
        "required": ["symbol"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "place_order", "parameters": {
        "type": "object", "properties": {
            "symbol": {"type": "string", "maxLength": 5}, "side": {"enum": ["buy", "sell"]},
            "qty": {"type": "integer", "minimum": 1, "maximum": 500}},
        "required": ["symbol", "side", "qty"], "additionalProperties": False}}},
]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "place_order"}}])
def test_random_model_tool_calls_validate(choice, tokinfo):
    spec = tool_call_spec(TOOLS, tokinfo, choice)
    cache = ConstraintCache()
    for seed in range(5):
        c = build_constraint(spec, tokinfo, max_tokens=200, cache=cache)
        out = decode(c, random_logits(tokinfo.vocab_size + 16, seed), max_tokens=200)
        assert out.finished
        text = tokinfo.decode(out.ids[:-1])
        calls = validate_tool_calls(text, TOOLS, choice)
        assert calls and text.startswith("<tool_call>\n{\"name\": ")
        if isinstance(choice, dict):
            assert {c["name"] for c in calls} == {"place_order"}


def test_parallel_calls_and_parser():
    text = ('Checking.<tool_call>\n{"name": "get_quote", "arguments": {"symbol": "AAPL"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "place_order", "arguments": {"symbol": "AAPL", "side": "buy", "qty": 5}}\n</tool_call>')
    calls = validate_tool_calls(text, TOOLS, "auto")
    assert [c["name"] for c in calls] == ["get_quote", "place_order"]
    assert text_before_tool_calls(text) == "Checking."
    with pytest.raises(StructuredValidationError):
        validate_tool_calls(text, TOOLS, "auto", parallel_tool_calls=False)
    with pytest.raises(StructuredValidationError):
        validate_tool_calls(text.replace('"qty": 5', '"qty": 900'), TOOLS, "auto")
    with pytest.raises(ToolCallParseError):
        parse_tool_calls('<tool_call>\n{"name": "get_quote", "arguments": {\n</tool_call>')
    with pytest.raises(ToolCallParseError):
        parse_tool_calls('<tool_call>\n{"name": "get_quote"')


def _allowed(c, tokinfo, ids):
    logits = torch.zeros(tokinfo.vocab_size)
    c(ids, logits)
    return set(torch.isfinite(logits).nonzero().flatten().tolist())


def test_tool_choice_modes_gate_the_call_token(tokinfo):
    open_id = tokinfo.token_id("<tool_call>")
    cache = ConstraintCache()
    none = build_constraint(tool_call_spec(TOOLS, tokinfo, "none"), tokinfo, cache=cache)
    assert open_id not in _allowed(none, tokinfo, [])
    auto = build_constraint(tool_call_spec(TOOLS, tokinfo, "auto"), tokinfo, cache=cache)
    assert open_id in _allowed(auto, tokinfo, []) and len(_allowed(auto, tokinfo, [])) > 100
    required = build_constraint(tool_call_spec(TOOLS, tokinfo, "required"), tokinfo, cache=cache)
    assert _allowed(required, tokinfo, []) == {open_id}
    ids = [open_id] + tokinfo.encode('\n{"name": "')
    named = build_constraint(tool_call_spec(TOOLS, tokinfo, {"function": {"name": "get_quote"}}), tokinfo, cache=cache)
    named.advance(ids)
    assert not named.error
    bad = build_constraint(tool_call_spec(TOOLS, tokinfo, {"function": {"name": "get_quote"}}), tokinfo, cache=cache)
    assert not all(bad.consume(t) for t in ids + tokinfo.encode("place_order"))


def test_named_choice_must_exist(tokinfo):
    with pytest.raises(ConstraintCompileError):
        tool_call_spec(TOOLS, tokinfo, {"type": "function", "function": {"name": "wire_money"}})
