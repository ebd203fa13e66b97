"""JSON Schema parsing, walking and normalisation; the outlines-core keyword audit (llguidance's
side: json_enforce.py)."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from typing import Any

import jsonschema

from .errors import ConstraintCompileError, UnsupportedSchemaError

# Keywords that only annotate (no effect on which instances are valid).
ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "example", "$comment", "$schema", "$id", "id",
    "deprecated", "readOnly", "writeOnly", "contentMediaType", "contentEncoding", "$anchor",
    "markdownDescription", "x-guidance",
})
# Sub-schema containers (the walk recurses through them).
_MAP_OF_SCHEMAS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_LIST_OF_SCHEMAS = ("anyOf", "oneOf", "allOf", "prefixItems")
_ONE_SCHEMA = ("additionalProperties", "items", "additionalItems", "not", "if", "then", "else",
               "contains", "propertyNames", "unevaluatedProperties", "unevaluatedItems")

# What llguidance's grammar enforces (json_enforce.py decides the rest); outlines-core rejects what it cannot.
LLGUIDANCE_KEYWORDS = frozenset({
    "type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions",
    "properties", "required", "additionalProperties", "patternProperties", "minProperties",
    "maxProperties", "items", "prefixItems", "additionalItems", "minItems", "maxItems",
    "minLength", "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "multipleOf",
})
# outlines-core's JSON-Schema regex ignores numeric bounds and its email pattern is unsound.
OUTLINES_KEYWORDS = frozenset({
    "type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions",
    "properties", "required", "additionalProperties", "items", "prefixItems", "minItems",
    "maxItems", "minLength", "maxLength", "pattern", "format",
})
OUTLINES_FORMATS = frozenset({"date-time", "date", "time", "uuid", "uri"})
# The JSON Schema vocabulary (drafts 4 to 2020-12). A vocabulary keyword the backend does not
# enforce is rejected; keys outside the vocabulary are not keywords (the spec and every validator
# ignore them: `javaType`, `_comment`, typos...) so they constrain nothing and are skipped.
VOCABULARY = LLGUIDANCE_KEYWORDS | ANNOTATIONS | frozenset({
    "not", "if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
    "propertyNames", "unevaluatedProperties", "unevaluatedItems", "contains", "minContains",
    "maxContains", "uniqueItems", "$dynamicRef", "$dynamicAnchor", "$recursiveRef",
    "$recursiveAnchor", "$vocabulary", "extends", "disallow", "divisibleBy",
})


def parse_schema(schema: str | dict | bool) -> dict | bool:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ConstraintCompileError("json_schema", f"schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict | bool):
        raise ConstraintCompileError("json_schema", "a JSON Schema must be an object or a boolean")
    return schema


# Keywords that only 2019-09 / 2020-12 define: a schema without `$schema` that uses none is tried as draft 7 first.
_MODERN = frozenset({"prefixItems", "$defs", "dependentRequired", "dependentSchemas", "unevaluatedProperties",
                     "unevaluatedItems", "$dynamicRef", "$dynamicAnchor", "$anchor", "minContains", "maxContains",
                     "$recursiveRef", "$recursiveAnchor"})
_DRAFTS = (jsonschema.Draft202012Validator, jsonschema.Draft7Validator, jsonschema.Draft6Validator,
           jsonschema.Draft4Validator)


@functools.cache
def meta_validator(cls: type) -> jsonschema.protocols.Validator:
    """A draft's meta-schema validator, built once (building one per schema costs milliseconds)."""
    return cls(cls.META_SCHEMA)


def validator_class(schema: dict | bool) -> type:
    """The draft a schema is written in: its `$schema`, else the newest draft whose meta-schema it
    satisfies (real schemas often omit `$schema` and use draft-4 forms such as tuple `items`)."""
    if isinstance(schema, dict) and "$schema" in schema:
        return jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    modern = any(_MODERN & sub.keys() for _, sub in walk(schema))
    for cls in _DRAFTS if modern else (*_DRAFTS[1:], _DRAFTS[0]):  # draft 7's meta-schema checks 3x faster
        if meta_validator(cls).is_valid(schema):
            return cls
    return jsonschema.Draft202012Validator


def walk(schema: Any, path: str = "#") -> Iterator[tuple[str, dict]]:
    """Yield (json-pointer path, sub-schema) for every dict sub-schema."""
    if not isinstance(schema, dict):
        return
    yield path, schema
    for key in _MAP_OF_SCHEMAS:
        for name, sub in (schema.get(key) or {}).items() if isinstance(schema.get(key), dict) else ():
            yield from walk(sub, f"{path}/{key}/{name}")
    for key in _LIST_OF_SCHEMAS:
        for i, sub in enumerate(schema.get(key) or []) if isinstance(schema.get(key), list) else ():
            yield from walk(sub, f"{path}/{key}/{i}")
    for key in _ONE_SCHEMA:
        sub = schema.get(key)
        if isinstance(sub, list):  # draft-4 tuple `items`
            for i, s in enumerate(sub):
                yield from walk(s, f"{path}/{key}/{i}")
        elif isinstance(sub, dict):
            yield from walk(sub, f"{path}/{key}")


def audit(schema: dict | bool, keywords: frozenset[str], formats: frozenset[str], backend: str) -> None:
    """Raise UnsupportedSchemaError for the first keyword or format the backend would not enforce."""
    for path, sub in walk(schema):
        for key, value in sub.items():
            if key in ANNOTATIONS or key not in VOCABULARY:
                continue
            if key == "uniqueItems" and value is False:
                continue  # asserts nothing
            if key not in keywords:
                raise UnsupportedSchemaError(key, path, backend=backend)
            if key == "format" and value not in formats:
                raise UnsupportedSchemaError("format", path, f"format {value!r} is not enforced", backend)
            if key == "$ref" and isinstance(value, str) and not value.startswith("#"):
                raise UnsupportedSchemaError("$ref", path, f"remote reference {value!r}", backend)
            if key == "type":
                for t in [value] if isinstance(value, str) else value:
                    if t not in ("object", "array", "string", "number", "integer", "boolean", "null"):
                        raise UnsupportedSchemaError("type", path, f"unknown type {t!r}", backend)


# date / time / date-time as the validator (jsonschema + rfc3339-validator) accepts them: llguidance's
# own formats also admit second 60, lower-case t/z and 02-29 of any year, which it rejects.
_DATE = (r"[1-9][0-9]{3}-(?:(?:0[1-9]|1[0-2])-(?:0[1-9]|1[0-9]|2[0-8])|(?:0[13-9]|1[0-2])-(?:29|30)"
         r"|(?:0[13578]|1[02])-31)")
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,6})?(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
STRICT_FORMATS = {"date": f"^{_DATE}$", "time": f"^{_TIME}$", "date-time": f"^{_DATE}T{_TIME}$"}


def normalise(schema: dict | bool) -> dict | bool:
    """Rewrite draft-4 boolean exclusiveMinimum/Maximum into draft-6+ numbers (same meaning), and
    date/time/date-time formats into the anchored patterns of STRICT_FORMATS (a subset of each)."""
    if not isinstance(schema, dict):
        return schema
    out = json.loads(json.dumps(schema))
    for _, sub in walk(out):
        if sub.get("format") in STRICT_FORMATS and "pattern" not in sub:
            sub["pattern"] = STRICT_FORMATS[sub.pop("format")]
        for flag, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            if isinstance(sub.get(flag), bool):
                if sub.pop(flag) and bound in sub:
                    sub[flag] = sub.pop(bound)
    return out


# llguidance's JSON options: compact JSON (no free whitespace), unknown keywords are errors, oneOf
# only where its branches are provably disjoint (json_enforce relaxes these step by step).
STRICT_JSON_OPTIONS = {"whitespace_flexible": False, "lenient": False, "coerce_one_of": False}


def outlines_json_regex(schema: dict | bool) -> str:
    from outlines_core.json_schema import build_regex_from_schema

    audit(schema, OUTLINES_KEYWORDS, OUTLINES_FORMATS, "outlines-core")
    try:
        return build_regex_from_schema(json.dumps(normalise(schema)), whitespace_pattern="")
    except Exception as e:  # the Rust converter raises ValueError/TypeError on unsupported input
        raise ConstraintCompileError("json_schema", f"outlines-core: {e}") from None
