"""Read-only built-in SQL functions per dialect: the default allow-list of generated SQL.

Each dialect's list is its documented scalar (date/time, string, math, conditional), aggregate and
window functions that read their arguments only; functions that touch files, the session, the
server, extensions or randomness-as-a-side-channel (load_extension, readfile, pg_read_file,
pg_sleep, set_config, lo_import, dblink, ...) are not built-ins of any list here. A policy narrows
the list with `SQLPolicy.allowed_functions`.
"""

from __future__ import annotations

import functools

import sqlglot
from sqlglot import exp
from sqlglot.errors import ParseError, TokenError

AGGREGATES = ("count", "sum", "avg", "min", "max")
WINDOW = ("row_number", "rank", "dense_rank", "percent_rank", "cume_dist", "ntile", "lag", "lead",
          "first_value", "last_value", "nth_value")

_COMMON_SCALAR = (
    "abs", "round", "lower", "upper", "length", "substr", "substring", "coalesce", "nullif", "trim",
    "ltrim", "rtrim", "replace", "ceil", "ceiling", "floor", "sign", "sqrt", "power", "mod", "exp", "ln",
)

_DIALECT = {
    # https://sqlite.org/lang_corefunc.html, lang_datefunc.html, lang_mathfunc.html, lang_aggfunc.html
    "sqlite": _COMMON_SCALAR + (
        "ifnull", "iif", "instr", "char", "hex", "unicode", "quote", "typeof", "printf", "format", "concat", "concat_ws", "octet_length", "pow", "log", "log10", "log2", "pi", "trunc",
        "date", "time", "datetime", "julianday", "unixepoch", "strftime", "timediff",
        "total", "group_concat", "string_agg",
    ),
    # https://www.postgresql.org/docs/current/functions.html (string, math, date/time, conditional, aggregate)
    "postgres": _COMMON_SCALAR + (
        "greatest", "least", "concat", "concat_ws", "left", "right", "lpad", "rpad", "reverse", "strpos",
        "split_part", "char_length", "character_length", "octet_length", "initcap", "repeat", "md5", "ascii",
        "translate", "regexp_replace", "starts_with",
        "to_char", "to_date", "to_timestamp", "to_number", "date_trunc", "date_part", "age",
        "make_date", "make_timestamp", "now", "log", "log10", "pi", "trunc", "div", "cbrt", "degrees",
        "radians", "string_agg", "array_agg", "bool_and", "bool_or", "every", "stddev", "stddev_pop",
        "stddev_samp", "variance", "var_pop", "var_samp",
    ),
    "mysql": _COMMON_SCALAR + (
        "ifnull", "if", "instr", "locate", "concat", "concat_ws", "left", "right", "lpad", "rpad", "reverse",
        "char_length", "date", "time", "year", "month", "day", "hour", "minute", "second", "dayofweek",
        "datediff", "date_add", "date_sub", "date_format", "str_to_date", "now", "curdate", "greatest",
        "least", "log", "log10", "pow", "truncate", "group_concat", "stddev", "variance",
    ),
    "duckdb": _COMMON_SCALAR + (
        "ifnull", "greatest", "least", "concat", "concat_ws", "left", "right", "lpad", "rpad", "reverse",
        "strpos", "instr", "split_part", "strftime", "strptime", "date_trunc", "date_part", "date_diff",
        "datediff", "year", "month", "day", "now", "log", "log10", "pow", "string_agg", "list", "median",
        "stddev", "variance",
    ),
    "bigquery": _COMMON_SCALAR + (
        "ifnull", "if", "greatest", "least", "concat", "left", "right", "lpad", "rpad", "reverse", "strpos",
        "split", "format_date", "format_timestamp", "parse_date", "date_trunc", "date_diff", "date_add",
        "date_sub", "log", "log10", "pow", "safe_divide", "string_agg",
        "array_agg", "countif", "stddev", "variance",
    ),
    "snowflake": _COMMON_SCALAR + (
        "ifnull", "iff", "nvl", "greatest", "least", "concat", "concat_ws", "left", "right", "lpad", "rpad",
        "reverse", "split_part", "to_char", "to_date", "date_trunc", "datediff", "dateadd",
        "date_part", "year", "month", "day", "log", "pow", "listagg", "array_agg", "median", "stddev",
        "variance",
    ),
}


def default_functions(dialect: str) -> tuple[str, ...]:
    """The read-only functions allowed by default in `dialect` (aggregates and window functions included)."""
    return tuple(dict.fromkeys(AGGREGATES + _DIALECT[dialect] + WINDOW))


_MAX_PROBE = 6  # arities probed; a function that parses with this many takes any number from its least


@functools.lru_cache(maxsize=256)
def signature(dialect: str, name: str) -> tuple[int, int | None] | None:
    """(least, most) arguments with which sqlglot parses `name(...)` in `dialect` (most None: any
    number), or None where it parses with none; window functions are probed with an OVER clause."""
    over = " OVER (ORDER BY x)" if name in WINDOW else ""
    ok = []
    for n in range(_MAX_PROBE + 1):
        try:
            sqlglot.parse_one(f"SELECT {name}({', '.join(['x'] * n)}){over} FROM t", read=dialect)
            ok.append(n)
        except (ParseError, TokenError, AttributeError):  # (sqlglot's mysql parser fails on some arities)
            continue
    if not ok:
        return None
    least = ok[0]
    most = least
    while most + 1 in ok:
        most += 1
    return least, None if most == _MAX_PROBE else most


@functools.lru_cache(maxsize=256)
def function_nodes(dialect: str, name: str) -> frozenset[str]:
    """The sqlglot expressions that `name(...)` parses to in `dialect` at each arity it takes (and
    those it nests inside, e.g. STRFTIME's TsOrDsToTimestamp): class names, or for a function sqlglot
    does not model, `anonymous:<name>`."""
    sig = signature(dialect, name)
    if sig is None:
        return frozenset()
    over = " OVER (ORDER BY x)" if name in WINDOW else ""
    nodes = set()
    for n in range(sig[0], (sig[1] if sig[1] is not None else _MAX_PROBE) + 1):
        tree = sqlglot.parse_one(f"SELECT {name}({', '.join(['x'] * n)}){over} FROM t", read=dialect)
        nodes |= {node_name(f) for f in tree.find_all(exp.Func)}  # (with those sqlglot nests in it)
    return frozenset(nodes)


def node_name(node: exp.Expression) -> str:
    """How `function_nodes` names a parsed function call."""
    return f"anonymous:{node.name.lower()}" if isinstance(node, exp.Anonymous) else type(node).__name__
