"""A caller's database schema (tables and columns) and the SQL policy applied to generated SQL."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .errors import ConstraintCompileError
from .sql_functions import default_functions

DIALECTS = ("sqlite", "postgres", "mysql", "duckdb", "bigquery", "snowflake")


def tables_prompt(tables: Mapping[str, Sequence[str]]) -> str:
    """How a request's SQL tables are told to the model (a system line): `Tables: t(a, b); u(c). ...`.

    The constraint decides which names can be written; the model still has to know them to pick the
    right ones (a column called `price`, not `close`). The demo corpus writes the same line."""
    listed = "; ".join(f"{t}({', '.join(cols)})" for t, cols in tables.items())
    return f"Tables: {listed}. Reply with one SQL query."


@dataclass(frozen=True)
class DatabaseSchema:
    """tables: name -> column names (original spelling). Names are matched case-insensitively."""

    tables: dict[str, tuple[str, ...]]

    def __post_init__(self) -> None:
        if not self.tables:
            raise ConstraintCompileError("sql", "the database schema has no tables")
        for name, cols in self.tables.items():
            if not cols:
                raise ConstraintCompileError("sql", f"table {name!r} has no columns")

    @classmethod
    def from_mapping(cls, tables: dict[str, list[str] | tuple[str, ...]]) -> DatabaseSchema:
        return cls({t: tuple(c) for t, c in tables.items()})

    @classmethod
    def from_spider(cls, entry: dict) -> DatabaseSchema:
        """From one Spider `tables.json` entry (uses the original names)."""
        tables: dict[str, list[str]] = {t: [] for t in entry["table_names_original"]}
        for t_idx, col in entry["column_names_original"]:
            if t_idx >= 0:
                tables[entry["table_names_original"][t_idx]].append(col)
        return cls.from_mapping(tables)

    def columns(self) -> list[str]:
        seen: dict[str, str] = {}
        for cols in self.tables.values():
            for c in cols:
                seen.setdefault(c.lower(), c)
        return list(seen.values())

    def sqlglot_mapping(self) -> dict[str, dict[str, str]]:
        return {t: {c: "TEXT" for c in cols} for t, cols in self.tables.items()}


@dataclass(frozen=True)
class SQLPolicy:
    """Rules checked after decoding. `max_limit` adds/clamps a LIMIT; None leaves LIMIT free."""

    dialect: str = "sqlite"
    target_dialect: str | None = None  # transpile to this dialect (defaults to `dialect`)
    # None: the dialect's read-only built-ins (sql_functions.default_functions); a tuple narrows them
    allowed_functions: tuple[str, ...] | None = None
    max_limit: int | None = 1000
    allowed_tables: tuple[str, ...] | None = None  # None: every table of the schema
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for d in (self.dialect, self.target_dialect or self.dialect):
            if d not in DIALECTS:
                raise ConstraintCompileError("sql", f"unknown SQL dialect {d!r}; supported: {', '.join(DIALECTS)}")
        if self.allowed_functions is not None:
            object.__setattr__(self, "allowed_functions", tuple(f.lower() for f in self.allowed_functions))
        if self.max_limit is not None and self.max_limit < 1:
            raise ConstraintCompileError("sql", f"max_limit must be >= 1, got {self.max_limit}")

    @property
    def functions(self) -> tuple[str, ...]:
        """The allowed function names, lower case."""
        return self.allowed_functions if self.allowed_functions is not None else default_functions(self.dialect)
