"""Every JSON Schema keyword family compiles, with how it is enforced reported; finite numbers; open objects."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from evals.structured.driver import decode, random_logits
from gateway.structured.bitmask import bitmask_words, row_allows
from gateway.structured.build import build_constraint, json_schema_spec
from gateway.structured.cache import ConstraintCache
from gateway.structured.errors import ConstraintCompileError, StructuredValidationError
from gateway.structured.validate import validate_json


def _compile(schema, tokinfo, max_tokens=None):
    return build_constraint(json_schema_spec(schema), tokinfo, cache=ConstraintCache(), max_tokens=max_tokens)


def _allowed_path(c, tokinfo, text: str) -> bool:
    """Whether the constraint's masks admit `text` token by token (its canonical tokenization) as a
    complete output."""
    bitmask = torch.empty(1, bitmask_words(tokinfo.vocab_size), dtype=torch.int32)
    for t in tokinfo.encode(text):
        c.fill_bitmask(bitmask, 0)
        if not row_allows(bitmask[0].numpy().view(np.uint32), np.array([t]))[0]:
            return False
        c.consume(t)
    return c.is_accepting()


@pytest.mark.parametrize("schema, keyword, method", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems", "validation"),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not", "grammar"),
    ({"type": "object", "properties": {"a": {"type": "string", "not": {"enum": ["x"]}}}}, "not", "validation"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "not": {"required": ["a"]}}, "not", "grammar"),
    ({"if": {"type": "string"}, "then": {"minLength": 2}, "else": {"type": "integer"}}, "if", "validation"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired", "grammar"),
    ({"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}}, "dependentSchemas", "validation"),
    ({"type": "object", "properties": {"a": {}}, "dependencies": {"a": ["b"]}}, "dependencies", "grammar"),
    ({"type": "object", "dependencies": {"a": ["b"], "c": {"required": ["d"]}}}, "dependencies", "validation"),
    ({"oneOf": [{"type": "number"}, {"type": "integer"}]}, "oneOf", "grammar+validation"),  # overlapping
    ({"oneOf": [{"type": "string"}, {"type": "integer"}]}, "oneOf", "grammar"),  # provably disjoint
    ({"type": "object", "properties": {"a": {}, "b": {}, "c": {}},  # exactly one of these argument sets
      "oneOf": [{"required": ["a"]}, {"required": ["b", "c"]}]}, "oneOf", "grammar"),
    ({"type": "object", "oneOf": [{"required": ["a"]}, {"required": ["a", "b"]}]}, "oneOf", "grammar"),
    ({"type": "object", "patternProperties": {"^x-": {"type": "integer"}}}, "patternProperties", "grammar"),
    ({"$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}},
      "$ref": "#/$defs/node"}, "$ref", "grammar"),  # recursive
    ({"type": "integer", "format": "int32"}, "format:int32", "annotation"),  # OpenAPI format
    ({"type": "string", "format": "url"}, "format:url", "annotation"),
    ({"type": "string", "format": "json-pointer"}, "format:json-pointer", "validation"),  # jsonschema checks it
    ({"type": "string", "format": "email"}, "format:email", "grammar"),
    ({"type": "array", "contains": {"type": "integer"}}, "contains", "validation"),
    ({"type": "object", "propertyNames": {"maxLength": 3}}, "propertyNames", "validation"),
    ({"type": "number", "minimum": 0, "maximum": 1e20}, "maximum", "validation"),  # beyond llguidance's ranges
])
def test_keyword_families_compile_with_their_enforcement(schema, keyword, method, tokinfo):
    c = _compile(schema, tokinfo)
    assert c.compiled.enforcement.to_dict()["keywords"][keyword] == method


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"not": {"type": ["string", "object", "array"]}}}, "required": ["a"]},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "not": {"required": ["b"]}},
    {"oneOf": [{"type": "string", "maxLength": 3}, {"type": "integer", "minimum": 0, "maximum": 9}]},
    {"type": "object", "properties": {"side": {"type": "integer"}, "base": {"type": "number"}, "height": {"type": "number"},
                                      "radius": {"type": "number"}},
     "oneOf": [{"required": ["side"]}, {"required": ["base", "height"]}, {"required": ["radius"]}]},
    {"type": "object", "properties": {"card": {"type": "integer"}, "billing": {"type": "string", "maxLength": 4},
                                      "cvv": {"type": "integer"}, "note": {"type": "string", "maxLength": 4}},
     "dependentRequired": {"card": ["billing", "cvv"]}, "dependencies": {"note": ["cvv"]}},
])
def test_grammar_enforced_rewrites_always_validate(schema, tokinfo):
    for seed in range(6):
        out = decode(_compile(schema, tokinfo, 64), random_logits(tokinfo.vocab_size, seed), max_tokens=64)
        assert out.finished
        validate_json(tokinfo.decode(out.ids[:-1]), schema)


def test_one_of_required_sets_keep_their_meaning(tokinfo):
    """Exactly one set complete: keys of another set may appear as long as that set stays incomplete."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "integer"}},
              "required": ["b"], "oneOf": [{"required": ["a"]}, {"required": ["b", "c"]}]}
    for text in ('{"a":1,"b":2}', '{"b":2,"c":3}', '{"a":1,"b":2,"c":3}', '{"b":2}'):
        ok = _allowed_path(_compile(schema, tokinfo), tokinfo, text)
        try:
            validate_json(text, schema)
            valid = True
        except StructuredValidationError:
            valid = False
        assert ok is valid, text
    with pytest.raises(ConstraintCompileError, match="admits no value"):  # every set is complete: two match
        _compile({"type": "object", "required": ["a", "b"], "oneOf": [{"required": ["a"]}, {"required": ["b"]}]},
                 tokinfo)


def test_dependencies_in_the_grammar(tokinfo):
    schema = {"type": "object", "properties": {"card": {"type": "integer"}, "cvv": {"type": "integer"}},
              "dependentRequired": {"card": ["cvv"]}}
    for text, ok in (('{"card":1}', False), ('{"card":1,"cvv":2}', True), ('{"cvv":2}', True), ("{}", True)):
        assert _allowed_path(_compile(schema, tokinfo), tokinfo, text) is ok, text


def test_a_subschema_llguidance_cannot_compile_is_left_to_validation(tokinfo):
    """A recursive $ref intersected with a sibling: llguidance names the definition; only it is relaxed."""
    schema = {"definitions": {"Child": {"type": "object", "properties": {"n": {"type": "integer"}}},
                              "Foo": {"type": "object", "properties": {
                                  "kids": {"allOf": [{"$ref": "#/definitions/Foo"}, {"$ref": "#/definitions/Child"}]}}}},
              "type": "object", "properties": {"foo": {"$ref": "#/definitions/Foo"}, "id": {"type": "integer"}},
              "required": ["id"]}
    c = _compile(schema, tokinfo)
    assert c.compiled.enforcement.keywords["subschema:#/definitions/Foo"] == "validation"
    assert c.compiled.enforcement.keywords["required"] == "grammar"
    assert not _allowed_path(_compile(schema, tokinfo), tokinfo, '{"foo":{}}')  # `id` still required by the grammar
    assert _allowed_path(_compile(schema, tokinfo), tokinfo, '{"foo":{"kids":{}},"id":1}')


def test_invalid_and_unsatisfiable_schemas_are_typed_400(tokinfo):
    with pytest.raises(ConstraintCompileError) as err:
        _compile({"type": "dict"}, tokinfo)
    assert err.value.http_status == 400 and "not a valid" in str(err.value) and "#/type" in str(err.value)
    with pytest.raises(ConstraintCompileError) as err:
        _compile({"type": "object", "properties": {"a": {"minimum": "zero"}}}, tokinfo)
    assert "#/properties/a/minimum" in str(err.value)
    with pytest.raises(ConstraintCompileError, match="unsatisfiable|admits no value"):
        _compile(False, tokinfo)
    with pytest.raises(ConstraintCompileError, match="admits no value"):
        _compile({"type": "integer", "minimum": 5, "maximum": 1}, tokinfo)


def test_meaning_preserving_repairs_and_drafts_without_schema_uri(tokinfo):
    # duplicate enum entries and an empty draft-4 `required` are repaired; tuple `items` is draft-4
    _compile({"type": "string", "enum": ["a", "b", "a"]}, tokinfo)
    _compile({"$schema": "http://json-schema.org/draft-04/schema#", "type": "object", "required": []}, tokinfo)
    c = _compile({"type": "array", "items": [{"type": "integer"}], "additionalItems": False}, tokinfo)
    assert _allowed_path(c, tokinfo, "[1]")
    # draft-3 forms keep their draft-3 meaning: `required: true` on a property, `type: "any"`
    draft3 = {"type": "object", "properties": {"id": {"type": "integer", "required": True}, "x": {"type": "any"}}}
    assert not _allowed_path(_compile(draft3, tokinfo), tokinfo, '{"x":1}')
    assert _allowed_path(_compile(draft3, tokinfo), tokinfo, '{"id":1,"x":"a"}')
    with pytest.raises(StructuredValidationError, match="required"):
        validate_json('{"x":1}', draft3)


@pytest.mark.parametrize("text, ok", [
    ("[1e307]", True), ("[12e306]", True), ("[-9.5e-999]", True), ('["1e99999"]', True),
    ("[1e309]", False), ("[123e306]", False), ("[1125e2755992]", False), ("[1e-1000]", False),
])
def test_numbers_are_bounded_to_finite_doubles(text, ok, tokinfo):
    """Untyped values included: the guard applies to every number outside strings."""
    assert _allowed_path(_compile({"type": "array"}, tokinfo), tokinfo, text) is ok
    if '"' not in text:
        assert _allowed_path(_compile({"type": "array", "items": {"type": "number"}}, tokinfo), tokinfo, text) is ok


@pytest.mark.parametrize("value, ok", [("1e307", True), ("-2.5", True), ("1e309", False), ("2E7548356031961600", False)])
def test_tool_call_numbers_are_bounded_to_finite_doubles(value, ok, tokinfo):
    from gateway.structured.tools import tool_call_spec

    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}}}]
    c = build_constraint(tool_call_spec(tools, tokinfo, "required"), tokinfo, cache=ConstraintCache())
    text = f'<tool_call>\n{{"name": "f", "arguments": {{"x": {value}}}}}\n</tool_call>'
    assert _allowed_path(c, tokinfo, text) is ok


def test_validation_rejects_non_finite_numbers():
    with pytest.raises(StructuredValidationError, match="overflows a double"):
        validate_json('{"a": [1, 1e999]}', {"type": "object"})


def test_schema_number_bounds_in_the_grammar(tokinfo):
    schema = {"type": "number", "exclusiveMinimum": 0, "maximum": 100, "multipleOf": 0.5}
    assert _compile(schema, tokinfo).compiled.enforcement.keywords["multipleOf"] == "grammar"
    for text, ok in (("99.5", True), ("100", True), ("100.5", False), ("0", False), ("0.25", False)):
        assert _allowed_path(_compile(schema, tokinfo), tokinfo, text) is ok, text


def test_open_objects_generate_declared_properties_only(tokinfo):
    schema = {"type": "object", "properties": {"symbol": {"type": "string", "maxLength": 6},
                                               "qty": {"type": "integer", "minimum": 1}}, "required": ["symbol", "qty"]}
    c = _compile(schema, tokinfo, 64)
    assert any("not generated" in n for n in c.compiled.enforcement.notes)
    for seed in range(6):
        out = decode(_compile(schema, tokinfo, 64), random_logits(tokinfo.vocab_size, seed), max_tokens=64)
        value = validate_json(tokinfo.decode(out.ids[:-1]), schema)
        assert set(value) == {"symbol", "qty"}


@pytest.mark.parametrize("schema, needs", [
    # merged with a sibling: closing a member would forbid the other's properties
    ({"allOf": [{"properties": {"a": {"type": "integer"}}}, {"properties": {"b": {"type": "integer"}}}],
      "required": ["a", "b"]}, '{"a":1,"b":2}'),
    ({"properties": {"a": {"type": "integer"}}, "anyOf": [{"properties": {"b": {"const": 1}}, "required": ["b"]}]},
     '{"a":1,"b":1}'),
    # a required key the schema does not declare stays allowed
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "z"]}, '{"a":1,"z":true}'),
])
def test_closing_open_objects_keeps_satisfiable_schemas_satisfiable(schema, needs, tokinfo):
    assert _allowed_path(_compile(schema, tokinfo), tokinfo, needs)
    validate_json(needs, schema)


def test_caller_guidance_options_are_reported_not_applied(tokinfo):
    c = _compile({"type": "object", "x-guidance": {"whitespace_flexible": True, "lenient": True}}, tokinfo)
    assert any("x-guidance" in n for n in c.compiled.enforcement.notes)
    assert not _allowed_path(_compile({"type": "object", "x-guidance": {"whitespace_flexible": True}}, tokinfo),
                             tokinfo, '{ "a": 1 }')  # still compact


def test_json_object_mode_stays_open(tokinfo):
    c = _compile({"type": "object"}, tokinfo)
    assert _allowed_path(c, tokinfo, '{"any":[1,{"k":null}]}')
    assert json.loads('{"any":[1,{"k":null}]}')


def test_readme_order_grammar_admits_qty_10_with_the_demo_tokenizer():
    """The README's JSON example: with the demo model's tokenizer (one token per digit) the grammar
    lets `}` follow `10`; a longer quantity is the model's choice, not the grammar's."""
    from pathlib import Path

    from gateway.structured.vocab import TokenizerInfo

    path = Path(__file__).resolve().parents[3] / "engine/assets/demo-moe/tokenizer.json"
    tok = TokenizerInfo.from_file(str(path), (2, 0))  # generation_config.json eos_token_id
    schema = {"type": "object", "properties": {"symbol": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
              "required": ["symbol", "qty"], "additionalProperties": False}
    assert _allowed_path(_compile(schema, tok), tok, '{"symbol":"AAPL","qty":10}')
    assert not _allowed_path(_compile(schema, tok), tok, '{"symbol":"AAPL","qty":-0}')
