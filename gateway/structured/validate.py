"""Validation of every structured output after decoding: JSON Schema, tool calls, SQL."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

import jsonschema

from .errors import StructuredValidationError
from .json_enforce import repair
from .json_schema import normalise, parse_schema, validator_class
from .sql_schema import DatabaseSchema, SQLPolicy
from .sql_validate import SQLCheckResult, check_sql
from .tool_formats import DEFAULT, ToolFormat
from .tools import ToolSpec, _choice, parse_tool_calls


def _validator(schema: dict | bool) -> jsonschema.protocols.Validator:
    """The schema's validator, built once per distinct schema: building one checks the schema against each
    draft's meta-schema (milliseconds), which every request with the same response_format or tools repeated."""
    try:
        key = json.dumps(schema, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError):  # not plain JSON (e.g. a non-string key from YAML): built for this call only
        return _build_validator(schema)
    return _validator_of(key)


@lru_cache(maxsize=512)
def _validator_of(key: str) -> jsonschema.protocols.Validator:
    return _build_validator(json.loads(key))


def _build_validator(schema: dict | bool) -> jsonschema.protocols.Validator:
    schema = repair(schema)  # the same meaning-preserving repairs as the compile path
    cls = validator_class(schema)
    schema = normalise(schema)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def _non_finite(value: Any, path: str = "") -> str | None:
    """JSON path of the first number that is not a finite double (json.loads turns 1e999 into inf)."""
    if isinstance(value, float) and not math.isfinite(value):
        return path or "/"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        if (found := _non_finite(v, f"{path}/{k}")) is not None:
            return found
    return None


def check_json_value(value: Any, schema: dict | bool, kind: str = "json") -> None:
    if (where := _non_finite(value)) is not None:
        raise StructuredValidationError(kind, "a number overflows a double (not finite)", where)
    errors = sorted(_validator(schema).iter_errors(value), key=lambda e: list(e.absolute_path))
    if errors:
        first = errors[0]
        path = "/" + "/".join(str(p) for p in first.absolute_path)
        raise StructuredValidationError(kind, first.message[:300], path)


@contextmanager
def _within_depth(kind: str) -> Iterator[None]:
    """The JSON parser and the checks recurse once per nesting level: a RecursionError is the output's fault."""
    try:
        yield
    except RecursionError:
        raise StructuredValidationError(kind, "nested too deeply to check") from None


def validate_json(text: str, schema: str | dict | bool) -> Any:
    """Parse decoded text as one JSON value and check it against the schema; returns the value."""
    with _within_depth("json"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise StructuredValidationError("json", f"not valid JSON: {e}") from None
        check_json_value(value, parse_schema(schema))
    return value


def validate_tool_calls(
    text: str, tools: list[dict], tool_choice: str | dict | None = "auto", parallel_tool_calls: bool = True,
    fmt: ToolFormat = DEFAULT,
) -> list[dict]:
    """Parse the tool calls (in format `fmt`) and check names, arguments and tool_choice; returns the calls."""
    with _within_depth("tool_call"):
        calls = parse_tool_calls(text, tools, fmt)
        specs = {t.name: t for t in (ToolSpec.from_openai(x) for x in tools)}
        mode, forced = _choice(tool_choice)
        if mode == "none" and calls:
            raise StructuredValidationError("tool_call", "tool_choice is 'none' but the output calls a tool")
        if mode in ("required", "named") and not calls:
            raise StructuredValidationError("tool_call", f"tool_choice is {mode!r} but the output has no tool call")
        if not parallel_tool_calls and len(calls) > 1:
            raise StructuredValidationError("tool_call", f"parallel_tool_calls is false but got {len(calls)} calls")
        for i, call in enumerate(calls):
            if forced is not None and call["name"] != forced:
                raise StructuredValidationError("tool_call", f"call {i} is {call['name']!r}, tool_choice forces {forced!r}")
            if call["name"] not in specs:
                raise StructuredValidationError("tool_call", f"call {i} names unknown tool {call['name']!r}")
            check_json_value(call["arguments"], specs[call["name"]].parameters, f"tool_call {call['name']} arguments")
        return calls


def validate_sql(text: str, schema: DatabaseSchema, policy: SQLPolicy | None = None) -> SQLCheckResult:
    return check_sql(text, schema, policy)
