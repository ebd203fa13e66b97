"""JSON Schema keywords through the real openai client: enforcement metadata, the strict retry on a
validation-only keyword, open objects, typed 400s."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest


def _json(server, schema, **kw):
    kw.setdefault("messages", [{"role": "user", "content": "Buy 10 AAPL"}])
    return server.client().chat.completions.create(
        model="moegate-demo", temperature=0, max_tokens=kw.pop("max_tokens", 64),
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}, **kw)


def _retries(server) -> float:
    m = re.search(r"^moegate_strict_retries_total (\S+)$", server.state.metrics.render().decode(), re.M)
    return float(m.group(1)) if m else 0.0


def test_enforcement_per_keyword_in_the_response(gateway_server):
    schema = {"type": "object", "properties": {
        "ids": {"type": "array", "items": {"type": "integer", "format": "int64"}, "maxItems": 1, "uniqueItems": True},
        "side": {"oneOf": [{"const": "buy"}, {"enum": ["buy", "sell"]}]}}, "required": ["ids", "side"],
        "additionalProperties": False}
    # oneOf branches overlap ("buy" is in both): jsonschema requires exactly one, so only "sell" is valid. Which
    # one a model writes is its own choice (and a sampled retry's): tokens that would start "buy" are biased
    # away, so the response is the valid one whatever the checkpoint prefers; the budget is loose, as a tight one
    # lets the closing planner force the shortest way out ("buy") past the bias
    starts_b = {str(i): -100 for i, b in enumerate(gateway_server.state.generator.tok.token_bytes)
                if b and b.lstrip(b" \t\n").removeprefix(b'"').startswith(b"b")}
    r = _json(gateway_server, schema, logit_bias=starts_b, max_tokens=256)
    value = json.loads(r.choices[0].message.content)
    jsonschema.validate(value, schema)
    assert value["side"] == "sell"
    kw = r.model_extra["moegate"]["choices"][0]["enforcement"]["keywords"]
    assert kw["uniqueItems"] == "validation" and kw["format:int64"] == "annotation"
    assert kw["oneOf"] == "grammar+validation" and kw["properties"] == "grammar"


def test_enforcement_in_the_last_stream_chunk(gateway_server):
    stream = gateway_server.client().chat.completions.create(
        model="moegate-demo", temperature=0, max_tokens=32, stream=True,
        messages=[{"role": "user", "content": "Buy 10 AAPL"}],
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "array", "items": {"type": "integer"}, "maxItems": 2, "uniqueItems": True}}})
    chunks = list(stream)
    ext = chunks[-1].model_extra["moegate"]
    assert ext["enforcement"]["keywords"]["uniqueItems"] == "validation"


def test_unique_items_violation_is_retried_then_typed(gateway_server):
    """Every output of this schema repeats an item: the first attempt fails validation, the bounded
    strict retry runs, and the request ends with a typed 400, never the invalid array."""
    before = _retries(gateway_server)
    with pytest.raises(openai.BadRequestError) as e:
        _json(gateway_server, {"type": "array", "items": {"const": "a"}, "minItems": 2, "maxItems": 2,
                               "uniqueItems": True})
    assert e.value.code == "structured_output_invalid" and "non-unique" in e.value.message
    assert _retries(gateway_server) >= before + 1


def test_open_object_generates_declared_properties(gateway_server):
    schema = {"type": "object", "properties": {"symbol": {"type": "string", "maxLength": 8},
                                               "qty": {"type": "integer", "minimum": 1}}, "required": ["symbol", "qty"]}
    r = _json(gateway_server, schema, max_tokens=48)
    value = json.loads(r.choices[0].message.content)
    jsonschema.validate(value, schema)
    assert set(value) == {"symbol", "qty"} and r.choices[0].finish_reason == "stop"
    assert any("not generated" in n for n in r.model_extra["moegate"]["choices"][0]["enforcement"]["notes"])


@pytest.mark.parametrize("schema, words", [
    ({"type": "object", "properties": {"a": {"type": "strin"}}}, "not a valid"),
    ({"type": "integer", "minimum": 3, "maximum": 2}, "admits no value"),
])
def test_invalid_or_unsatisfiable_schema_is_400(gateway_server, schema, words):
    with pytest.raises(openai.BadRequestError) as e:
        _json(gateway_server, schema)
    assert words in e.value.message

