"""Per-field scoring of structured outputs: how many expected argument / JSON fields or SQL literals a model got right."""

from __future__ import annotations

from typing import Any


def leaves(value: Any, prefix: str = "") -> dict[str, Any]:
    """Flatten nested objects and arrays to {path: scalar}; e.g. {"a": [{"b": 1}]} -> {"a.0.b": 1}.

    An empty object or array is a leaf of its own, so `{"positions": []}` still has one field.
    """
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, sub in value.items():
            out.update(leaves(sub, f"{prefix}{key}."))
        return out
    if isinstance(value, list) and value:
        out = {}
        for i, sub in enumerate(value):
            out.update(leaves(sub, f"{prefix}{i}."))
        return out
    return {prefix.rstrip("."): value}


def _same(a: Any, b: Any) -> bool:
    """Exact equality that keeps JSON types apart (True is not 1, 1 is not 1.0 unless equal as numbers)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    return a == b


def missed_fields(got: Any, want: Any) -> list[str]:
    """Paths of the expected leaf fields that `got` does not reproduce (list indices written as `*`)."""
    produced = leaves(got) if got is not None else {}
    return [".".join("*" if part.isdigit() else part for part in path.split("."))
            for path, value in leaves(want).items() if not (path in produced and _same(produced[path], value))]


def field_matches(got: Any, want: Any) -> tuple[int, int]:
    """(expected leaf fields whose value `got` reproduces at the same path, expected leaf fields)."""
    expected = leaves(want)
    return len(expected) - len(missed_fields(got, want)), len(expected)


def sql_literals(sql: str) -> list[str]:
    """The string and number literals of a query (what a text-to-SQL model must copy from the question)."""
    import sqlglot
    from sqlglot import exp

    tree = sqlglot.parse_one(sql, read="sqlite")
    return [lit.this for lit in tree.find_all(exp.Literal)]


def sql_literal_matches(got: str | None, want: str) -> tuple[int, int]:
    """(literals of the reference query that also occur in `got`, counted with multiplicity; literals)."""
    expected = sql_literals(want)
    pool: list[str] = []
    if got is not None:
        try:
            pool = sql_literals(got)
        except Exception:  # noqa: BLE001 - an unparsable query copies nothing
            pool = []
    hits = 0
    for lit in expected:
        if lit in pool:
            pool.remove(lit)
            hits += 1
    return hits, len(expected)
