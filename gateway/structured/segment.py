"""Constraints for one fenced segment (```json / ```sql) opened inside free text.

The gateway's segment detector sees the opening fence line in the token stream, builds the
segment's constraint here and applies it from the next token; the constraint accepts the body
followed by the closing fence, and is terminated right after it, when the detector drops it.
"""

from __future__ import annotations

import json

from .base import ConstraintKind, ConstraintSpec
from .json_enforce import with_guidance_options
from .sql_grammar import SQL_START, sql_grammar
from .sql_schema import DatabaseSchema, SQLPolicy

FENCE_CLOSE = "\n```"
SEGMENT_LANGS = ("json", "sql")


def segment_spec(lang: str, json_schema: dict | bool | None = None, db_schema: DatabaseSchema | None = None,
                 policy: SQLPolicy | None = None) -> ConstraintSpec:
    """The constraint for the body of a ```<lang> fence plus its closing fence."""
    close = json.dumps(FENCE_CLOSE)
    if lang == "json":
        body = with_guidance_options(json_schema if json_schema is not None else {}, ", ", ": ")
        grammar = f"start: body {close}\nbody: %json {json.dumps(body)}\n"
        return ConstraintSpec(ConstraintKind.GRAMMAR, grammar)
    if lang == "sql":
        if db_schema is None:
            raise ValueError("a ```sql segment needs the caller's database schema")
        grammar = sql_grammar(db_schema, policy)
        if SQL_START not in grammar:
            raise RuntimeError("sql_grammar changed its start rule; update segment_spec")
        grammar = grammar.replace(SQL_START, f"{SQL_START} {close}", 1)
        return ConstraintSpec(ConstraintKind.SQL, grammar)
    raise ValueError(f"no segment constraint for fence language {lang!r}; known: {SEGMENT_LANGS}")


def segment_body(text: str) -> str:
    """The body of a decoded segment, without its closing fence."""
    return text[: -len(FENCE_CLOSE)] if text.endswith(FENCE_CLOSE) else text
