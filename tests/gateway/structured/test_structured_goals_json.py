"""Issue #25's JSON goals through a running gateway and the real openai client: each keyword family the issue
names compiles, the response names its enforcement method per keyword, and the output is schema-valid;
a keyword left to validation never lets an invalid output through (strict retry, then a typed 400)."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from gateway.structured.json_enforce import grammar_schema

OBJ = {"type": "object", "additionalProperties": False}
INT = {"type": "integer", "minimum": 0, "maximum": 99}


def _json(server, schema, max_tokens=96):
    return server.client().chat.completions.create(
        model="moegate-demo", temperature=0, max_tokens=max_tokens,
        messages=[{"role": "user", "content": "Buy 10 AAPL"}],
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})


def _keys(node) -> set[str]:
    """Every key anywhere in a JSON value (a superset of the schema keywords it writes)."""
    if isinstance(node, dict):
        return set(node).union(*(_keys(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_keys(v) for v in node))
    return set()


def _retries(server) -> float:
    m = re.search(r"^moegate_strict_retries_total (\S+)$", server.state.metrics.render().decode(), re.M)
    return float(m.group(1)) if m else 0.0


# (schema, {keyword: method the response must report}); every grammar here admits outputs the keyword forbids
# where its method is `validation`, so the validator decides (or, for `grammar`, the rewrite does)
CASES = {
    "not-grammar": ({**OBJ, "properties": {"qty": {"not": {"type": ["string", "object", "array", "boolean", "null"]}}},
                     "required": ["qty"]}, {"not": "grammar"}),
    "not-validation": ({**OBJ, "properties": {"side": {"enum": ["buy", "sell", "hold"], "not": {"const": "hold"}}},
                        "required": ["side"]}, {"not": "validation"}),
    "oneOf-disjoint": ({"oneOf": [{"type": "string", "maxLength": 6}, INT]}, {"oneOf": "grammar"}),
    "dependencies-array": ({**OBJ, "properties": {"a": INT, "b": INT}, "required": ["a"], "dependencies": {"a": ["b"]}},
                           {"dependencies": "grammar"}),
    "dependencies-schema": ({**OBJ, "properties": {"a": INT, "b": INT}, "required": ["a"],
                             "dependencies": {"a": {"properties": {"b": {"maximum": 50}}}}},
                            {"dependencies": "validation"}),
    "dependentRequired": ({**OBJ, "properties": {"a": INT, "b": INT}, "required": ["a"],
                           "dependentRequired": {"a": ["b"]}},
                          {"dependentRequired": "grammar"}),
    "dependentSchemas": ({**OBJ, "properties": {"a": INT, "b": INT}, "required": ["a", "b"],
                          "dependentSchemas": {"a": {"properties": {"b": {"minimum": 1}}}}},
                         {"dependentSchemas": "validation"}),
    "if-then-else": ({**OBJ, "properties": {"side": {"enum": ["buy", "sell"]}, "qty": INT}, "required": ["side", "qty"],
                      "if": {"properties": {"side": {"const": "buy"}}}, "then": {"properties": {"qty": {"minimum": 1}}},
                      "else": {"properties": {"qty": {"maximum": 90}}}},
                     {"if": "validation", "then": "validation", "else": "validation"}),
    "uniqueItems": ({"type": "array", "items": INT, "maxItems": 3, "uniqueItems": True}, {"uniqueItems": "validation"}),
    "patternProperties": ({"type": "object", "patternProperties": {"^x_[a-z]{1,3}$": INT},
                           "additionalProperties": False, "minProperties": 1, "maxProperties": 2},
                          {"patternProperties": "grammar"}),
    "recursive-$ref": ({"$defs": {"node": {**OBJ, "properties": {"v": INT, "next": {"$ref": "#/$defs/node"}},
                                           "required": ["v"]}}, "$ref": "#/$defs/node"}, {"$ref": "grammar"}),
    "formats": ({**OBJ, "properties": {"n": {"type": "integer", "format": "int32"},
                                       "u": {"type": "string", "format": "url", "maxLength": 8},
                                       "p": {"type": "string", "format": "json-pointer",
                                             "pattern": "^(/[a-z]{1,3}){0,2}$"},
                                       "e": {"type": "string", "format": "email", "maxLength": 24}},
                 "required": ["n", "u", "p", "e"]},
                {"format:int32": "annotation", "format:url": "annotation", "format:json-pointer": "validation",
                 "format:email": "grammar"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_keyword_method_in_the_response_and_the_output_is_valid(gateway_server, case):
    schema, methods = CASES[case]
    r = _json(gateway_server, schema, max_tokens=160)
    value = json.loads(r.choices[0].message.content)
    jsonschema.validate(value, schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    assert r.choices[0].finish_reason == "stop"
    reported = r.model_extra["moegate"]["choices"][0]["enforcement"]["keywords"]
    assert {k: reported.get(k) for k in methods} == methods, reported
    # only keywords the caller wrote: not the allOf / anyOf a dependencies or oneOf rewrite adds
    assert {k for k in reported if not k.startswith(("format:", "subschema:"))} <= _keys(schema), reported


@pytest.mark.parametrize("schema", [
    {**OBJ, "properties": {"a": INT, "b": INT}, "dependencies": {"a": ["b"]}},
    {**OBJ, "properties": {"a": INT, "b": INT}, "dependentRequired": {"a": ["b"]}},
    {"type": "object", "properties": {"a": {}, "b": {}, "c": {}},
     "oneOf": [{"required": ["a"]}, {"required": ["b", "c"]}]},
])
def test_rewrites_report_only_the_keywords_written(schema):
    """A rewrite's allOf / anyOf is how the grammar enforces the caller's keyword, not a keyword of theirs."""
    reported = grammar_schema(schema).enforcement.keywords
    assert set(reported) <= _keys(schema) and not {"allOf", "anyOf"} & set(reported), reported


# every output the grammar admits violates the validation-only keyword: the first attempt fails
# validation, the bounded strict retry runs, and the request ends in a typed 400, never the invalid value
NEVER_VALID = {
    "not": {"type": "string", "enum": ["hold"], "not": {"enum": ["hold"]}},
    "if-then": {**OBJ, "properties": {"side": {"const": "buy"}}, "required": ["side"],
                "if": {"properties": {"side": {"const": "buy"}}}, "then": {"required": ["qty"]}},
    "dependentSchemas": {**OBJ, "properties": {"a": {"const": 1}}, "required": ["a"],
                         "dependentSchemas": {"a": {"required": ["b"]}}},
    "dependencies": {**OBJ, "properties": {"a": {"const": 1}}, "required": ["a"],
                     "dependencies": {"a": {"required": ["b"]}}},
    "format:json-pointer": {"type": "string", "format": "json-pointer", "pattern": "^ab$"},
}


@pytest.mark.parametrize("case", list(NEVER_VALID))
def test_validation_keyword_never_returns_an_invalid_output(gateway_server, case):
    before = _retries(gateway_server)
    with pytest.raises(openai.BadRequestError) as e:
        _json(gateway_server, NEVER_VALID[case], max_tokens=48)
    assert e.value.code == "structured_output_invalid", e.value.message
    assert _retries(gateway_server) >= before + 1
