"""Unresolvable schemas, bad constraints and compile timeouts give typed 400 errors."""

from __future__ import annotations

import pytest

from gateway.structured.build import build_constraint, json_schema_spec, regex_spec
from gateway.structured.cache import CompileConfig, ConstraintCache
from gateway.structured.errors import (
    ConstraintCompileError,
    ConstraintCompileTimeout,
    StructuredOutputError,
    UnsupportedSchemaError,
)


def test_unresolvable_reference_is_typed_400(tokinfo):
    with pytest.raises(UnsupportedSchemaError) as err:
        build_constraint(json_schema_spec({"$ref": "https://example.com/order.json"}), tokinfo, cache=ConstraintCache())
    assert err.value.keyword == "$ref" and err.value.http_status == 400
    assert err.value.to_dict()["code"] == "unsupported_schema_feature"


def test_outlines_backend_rejects_bounds_it_cannot_enforce(tokinfo):
    schema = {"type": "object", "properties": {"qty": {"type": "integer", "minimum": 1}}}
    with pytest.raises(UnsupportedSchemaError) as err:
        build_constraint(json_schema_spec(schema), tokinfo, backend="outlines-core", cache=ConstraintCache())
    assert err.value.keyword == "minimum" and err.value.path == "#/properties/qty"
    # ...while the default backend enforces it
    build_constraint(json_schema_spec(schema), tokinfo, cache=ConstraintCache())


def test_non_vocabulary_keys_constrain_nothing_and_are_accepted(tokinfo):
    schema = {"type": "object", "javaType": "com.x.Order", "properties": {"a": {"type": "integer"}}}
    build_constraint(json_schema_spec(schema), tokinfo, cache=ConstraintCache())


def test_malformed_constraints(tokinfo):
    with pytest.raises(ConstraintCompileError):
        build_constraint(regex_spec("(unclosed"), tokinfo, cache=ConstraintCache())
    with pytest.raises(ConstraintCompileError):
        json_schema_spec("{not json")


def test_compile_timeout_is_typed(tokinfo):
    # ~300 patterned properties: tens of ms to compile, far past a 1 ms bound
    heavy = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1},40}}[0-9]{{2,{i % 5 + 3}}}$"}
                                              for i in range(300)}}
    cache = ConstraintCache(CompileConfig(timeout_s=1e-3))
    with pytest.raises(ConstraintCompileTimeout) as err:
        build_constraint(json_schema_spec(heavy), tokinfo, cache=cache)
    assert isinstance(err.value, StructuredOutputError) and err.value.http_status == 400
    assert len(cache) == 0


def test_unknown_backend_is_typed(tokinfo):
    from gateway.structured.errors import UnknownBackendError
    from gateway.structured.sql_grammar import sql_spec
    from gateway.structured.sql_schema import DatabaseSchema

    with pytest.raises(UnknownBackendError) as err:
        build_constraint(regex_spec("a"), tokinfo, backend="xgrammar", cache=ConstraintCache())
    assert err.value.http_status == 400
    with pytest.raises(UnknownBackendError):  # outlines-core has no CFG support
        build_constraint(sql_spec(DatabaseSchema.from_mapping({"t": ["a"]})), tokinfo,
                         backend="outlines-core", cache=ConstraintCache())
