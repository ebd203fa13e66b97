"""sqlglot checks on generated SQL: one read-only statement, real tables/columns, allowed
functions, an enforced LIMIT, then transpiled to the target dialect."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import sqlglot
from sqlglot import exp
from sqlglot.errors import OptimizeError, ParseError
from sqlglot.optimizer.qualify import qualify

from .errors import SQLPolicyViolation
from .sql_functions import function_nodes, node_name
from .sql_schema import DatabaseSchema, SQLPolicy

_READ_ROOTS = (exp.Select, exp.Union, exp.Intersect, exp.Except, exp.Subquery)
# Statement kinds that write, change schema or session, or leave SQL; rejected anywhere in the tree.
_FORBIDDEN_NAMES = (
    "Insert", "Update", "Delete", "Merge", "Create", "Drop", "Alter", "AlterTable", "TruncateTable",
    "Into", "Lock", "Command", "Pragma", "Set", "SetItem", "Copy", "Grant", "Revoke", "Attach",
    "Detach", "Transaction", "Commit", "Rollback", "Analyze", "Use", "LoadData", "Cache", "Uncache",
    "Refresh", "Describe", "Kill", "Summarize", "Export", "Declare", "Execute", "Replace", "Vacuum",
)
# (a function node of the same name is not a statement: sqlglot's Replace is the string function REPLACE(x, a, b))
_FORBIDDEN = tuple(getattr(exp, n) for n in _FORBIDDEN_NAMES if hasattr(exp, n) and not issubclass(getattr(exp, n), exp.Func))
_SYNTAX_FUNCS = (exp.Cast, exp.TryCast, exp.Case, exp.If, exp.Paren, exp.Connector, exp.Binary, exp.Unary, exp.Predicate)
# A call's argument that sqlglot writes bare but cannot read back bare in every call: SQLite's SUBSTR(a OR b)
# is written SUBSTRING(a OR b), which SUBSTRING's own FROM/FOR parser refuses.
_BOOLEAN_ARGS = (exp.Connector, exp.Predicate, exp.Not)


@dataclass
class SQLCheckResult:
    sql: str  # transpiled to the target dialect, LIMIT enforced
    tables: set[str] = field(default_factory=set)
    columns: set[str] = field(default_factory=set)  # "table.column", lower case
    rewrites: list[str] = field(default_factory=list)  # changes made (audited, never silent)


@functools.lru_cache(maxsize=64)
def _allowed_nodes(dialect: str, functions: tuple[str, ...]) -> frozenset[str]:
    """What the allowed function names parse to in `dialect` (STRFTIME is sqlglot's TimeToStr)."""
    return frozenset(n for f in functions for n in function_nodes(dialect, f))


def check_sql(sql: str, schema: DatabaseSchema, policy: SQLPolicy | None = None) -> SQLCheckResult:
    """Validate one generated statement; raise SQLPolicyViolation(rule, detail) on any breach.

    The result's `sql` (rewritten and transpiled, what the gateway returns) is checked again, in the target dialect:
    a statement whose rewrite this check would refuse is refused itself (rule `transpile`)."""
    policy = policy or SQLPolicy()
    try:
        result = _check_sql(sql, schema, policy)
        again = dataclasses.replace(policy, dialect=policy.target_dialect or policy.dialect, target_dialect=None)
        try:
            _check_sql(result.sql, schema, again)
        except SQLPolicyViolation as e:
            raise SQLPolicyViolation("transpile", f"the rewritten query fails the check: {e.detail}") from None
        return result
    except RecursionError:  # sqlglot's parser and walks recurse once per nesting level
        raise SQLPolicyViolation("parse", "nested too deeply to parse") from None


def _check_sql(sql: str, schema: DatabaseSchema, policy: SQLPolicy) -> SQLCheckResult:
    dialect = policy.dialect
    try:
        statements = [s for s in sqlglot.parse(sql, read=dialect) if s is not None]
    except (ParseError, sqlglot.errors.TokenError, ValueError) as e:  # (ValueError: sqlglot's builders, e.g. an
        # empty DATE_PART unit)
        raise SQLPolicyViolation("parse", f"not valid {dialect} SQL: {str(e).splitlines()[0][:200]}") from None
    if len(statements) != 1:
        raise SQLPolicyViolation("single_statement", f"expected exactly one statement, got {len(statements)}")
    tree = statements[0]
    if not isinstance(tree, _READ_ROOTS):
        raise SQLPolicyViolation("read_only", f"only SELECT queries are allowed, got {tree.key.upper()}")
    for node in tree.walk():
        if isinstance(node, _FORBIDDEN):
            raise SQLPolicyViolation("read_only", f"{node.key.upper()} is not allowed in a read-only query")
    for select in tree.find_all(exp.Select):  # sqlglot parses a bare `SELECT` (no database does)
        if not select.expressions:
            raise SQLPolicyViolation("parse", f"not valid {dialect} SQL: a SELECT without a column list")

    rewrites: list[str] = []
    if dialect == "sqlite":
        _sqlite_double_quoted_strings(tree, schema, rewrites)

    allowed_nodes = _allowed_nodes(dialect, policy.functions)
    for fn in tree.find_all(exp.Func):
        if isinstance(fn, _SYNTAX_FUNCS) or node_name(fn) in allowed_nodes:
            continue
        name = fn.name if isinstance(fn, exp.Anonymous) else fn.sql_name()
        raise SQLPolicyViolation("function_not_allowed", f"function {name.upper()} is not in the allow-list "
                                 f"({', '.join(sorted(policy.functions))})")

    known = {t.lower(): t for t in schema.tables}
    allowed_tables = {t.lower() for t in (policy.allowed_tables or schema.tables)}
    cte_names = {c.alias_or_name.lower() for c in tree.find_all(exp.CTE)}
    tables = set()
    for table in tree.find_all(exp.Table):
        name = table.name.lower()
        if name in cte_names:
            continue
        if name not in known:
            raise SQLPolicyViolation("unknown_table", f"table {table.name!r} is not in the database schema")
        if name not in allowed_tables:
            raise SQLPolicyViolation("table_not_allowed", f"table {table.name!r} is not allowed by the policy")
        tables.add(known[name])

    try:
        qualified = qualify(tree.copy(), schema=schema.sqlglot_mapping(), dialect=dialect,
                            validate_qualify_columns=True, quote_identifiers=False)
    except OptimizeError as e:
        raise SQLPolicyViolation("unknown_column", str(e).splitlines()[0][:300]) from None
    alias_to_table = {t.alias_or_name.lower(): t.name.lower() for t in qualified.find_all(exp.Table)
                      if t.name.lower() in known}
    columns = {f"{alias_to_table[c.table.lower()]}.{c.name.lower()}" for c in qualified.find_all(exp.Column)
               if c.table and c.table.lower() in alias_to_table}

    if policy.max_limit is not None:
        tree = _enforce_limit(tree, policy.max_limit, rewrites)
    for fn in list(tree.find_all(exp.Func)):
        if not isinstance(fn, _SYNTAX_FUNCS):
            for arg in [a for a in fn.iter_expressions() if isinstance(a, _BOOLEAN_ARGS)]:
                arg.replace(exp.Paren(this=arg.copy()))
    target = policy.target_dialect or dialect
    return SQLCheckResult(tree.sql(dialect=target), tables, columns, rewrites)


def _sqlite_double_quoted_strings(tree: exp.Expression, schema: DatabaseSchema, rewrites: list[str]) -> None:
    """SQLite reads a double-quoted token that names no column as a string literal; do the same."""
    columns = {c.lower() for cols in schema.tables.values() for c in cols}
    for col in list(tree.find_all(exp.Column)):
        ident = col.this
        if not col.table and isinstance(ident, exp.Identifier) and ident.quoted and ident.name.lower() not in columns:
            col.replace(exp.Literal.string(ident.name))
            rewrites.append(f'read "{ident.name}" as a string literal (SQLite rule for unknown quoted names)')


def _enforce_limit(tree: exp.Expression, max_limit: int, rewrites: list[str]) -> exp.Expression:
    limit = tree.args.get("limit")
    if limit is None:
        rewrites.append(f"added LIMIT {max_limit}")
        return tree.limit(max_limit, copy=False) if isinstance(tree, exp.Select) else (
            exp.select("*").from_(tree.subquery("q")).limit(max_limit))
    value = limit.expression
    if not isinstance(value, exp.Literal) or not value.is_int:
        raise SQLPolicyViolation("limit", f"LIMIT must be an integer literal, got {value.sql()}")
    if int(value.this) > max_limit:
        rewrites.append(f"clamped LIMIT {value.this} to {max_limit}")
        limit.set("expression", exp.Literal.number(max_limit))
    return tree
