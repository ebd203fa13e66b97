"""The per-schema validator cache: built once per distinct schema, keyed by content (a schema changed in place is
a new schema)."""

from __future__ import annotations

import pytest

from gateway.structured.errors import StructuredValidationError
from gateway.structured.validate import _validator, validate_json


def test_one_validator_per_distinct_schema():
    a = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    same = {"required": ["x"], "properties": {"x": {"type": "integer"}}, "type": "object"}  # other key order
    assert _validator(a) is _validator(same)
    assert _validator(a) is not _validator({**a, "additionalProperties": False})


def test_schema_changed_in_place_is_checked_as_changed():
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 8}}, "required": ["s"]}
    assert validate_json('{"s": "abcdef"}', schema) == {"s": "abcdef"}
    schema["properties"]["s"]["maxLength"] = 3
    with pytest.raises(StructuredValidationError, match="too long"):
        validate_json('{"s": "abcdef"}', schema)


def test_a_schema_that_is_not_plain_json_is_still_checked():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, 1: "a non-string key"}
    assert validate_json('{"n": 3}', schema) == {"n": 3}
    with pytest.raises(StructuredValidationError):
        validate_json('{"n": "x"}', schema)
