"""A Lark grammar (llguidance dialect) for read-only SELECT over one caller's database schema.

Tables and columns are literal terminals, so only real names can be produced; aliases and CTE
names are new identifiers; a CTE is named `cte_*` so that FROM can name it without letting
the model invent table names (sqlglot then checks it is bound). Keywords and unquoted names are case-insensitive; whitespace between
tokens is free in the grammar and bounded at decode time by the Constraint's whitespace limit.
"""

from __future__ import annotations

import json
import re

from .base import ConstraintKind, ConstraintSpec
from .sql_schema import AGGREGATES, DatabaseSchema, SQLPolicy

# Identifier quoting and string-literal forms per dialect.
_QUOTES = {
    "sqlite": ('"', "`", "["),
    "postgres": ('"',),
    "duckdb": ('"',),
    "snowflake": ('"',),
    "mysql": ("`",),
    "bigquery": ("`",),
}
_STRINGS = {
    "sqlite": r"""/'([^'\n]|'')*'/ | /"[^"\n]*"/""",
    "mysql": r"""/'([^'\\\n]|''|\\.)*'/ | /"[^"\\\n]*"/""",
}
_DEFAULT_STRING = r"""/'([^'\n]|'')*'/"""
_PLAIN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

_KEYWORDS = (
    "select", "distinct", "from", "where", "group", "by", "having", "order", "limit", "offset",
    "asc", "desc", "join", "inner", "left", "right", "full", "outer", "cross", "on", "using",
    "and", "or", "not", "in", "is", "null", "like", "between", "exists", "as", "union", "all",
    "intersect", "except", "with", "case", "when", "then", "else", "end", "cast", "true", "false",
)

_RULES = r"""
start: query ";"?
query: with_clause? compound order_by? limit_clause?
with_clause: WITH cte ("," cte)*
cte: CTE_NAME AS "(" query ")"
compound: select_core (set_op select_core)*
set_op: UNION ALL? | INTERSECT | EXCEPT
select_core: SELECT DISTINCT? select_list from_clause? where_clause? group_by? having?
select_list: select_item ("," select_item)*
select_item: "*" | qualifier "." "*" | expr (AS? NEW_NAME)?
from_clause: FROM source (join | "," source)*
source: (table | CTE_NAME) (AS? NEW_NAME)? | "(" query ")" (AS? NEW_NAME)?
join: join_kind? JOIN source (ON expr | USING "(" column ("," column)* ")")?
join_kind: INNER | CROSS | LEFT OUTER? | RIGHT OUTER? | FULL OUTER?
where_clause: WHERE expr
group_by: GROUP BY expr ("," expr)*
having: HAVING expr
order_by: ORDER BY order_item ("," order_item)*
order_item: expr (ASC | DESC)?
limit_clause: LIMIT INT (OFFSET INT)?

expr: and_expr (OR and_expr)*
and_expr: not_expr (AND not_expr)*
not_expr: NOT not_expr | predicate
predicate: sum_expr
    | sum_expr COMP sum_expr
    | sum_expr NOT? IN "(" (query | expr_list) ")"
    | sum_expr NOT? BETWEEN sum_expr AND sum_expr
    | sum_expr NOT? LIKE sum_expr
    | sum_expr IS NOT? NULL
    | EXISTS "(" query ")"
sum_expr: term (ADD_OP term)*
term: factor (MUL_OP factor)*
factor: "-" factor | primary
primary: literal | column_ref | call | "(" expr ")" | "(" query ")" | case_expr
    | CAST "(" expr AS TYPE_NAME ")"
case_expr: CASE expr? (WHEN expr THEN expr)+ (ELSE expr)? END
expr_list: expr ("," expr)*
call: (AGG | COUNT) "(" DISTINCT? expr ")" | COUNT "(" "*" ")" | FUNC "(" expr_list? ")"
column_ref: column | qualifier "." column
qualifier: table | NEW_NAME
literal: NUMBER | STRING | NULL | TRUE | FALSE

COMP: "=" | "!=" | "<>" | "<" | ">" | "<=" | ">="
ADD_OP: "+" | "-" | "||"
MUL_OP: "*" | "/" | "%"
INT: /[0-9]+/
NUMBER: /[0-9]+(\.[0-9]+)?/ | /\.[0-9]+/
TYPE_NAME: "integer"i | "int"i | "real"i | "float"i | "text"i | "numeric"i | "date"i | "varchar"i
NEW_NAME: /[A-Za-z_][A-Za-z0-9_]*/
CTE_NAME: /cte_[A-Za-z0-9_]*/
%ignore /[ \t\r\n]+/
"""


def _lit(text: str, insensitive: bool = True) -> str:
    return json.dumps(text) + ("i" if insensitive else "")


def _name_alternatives(name: str, dialect: str) -> list[str]:
    """Every way to write one table/column name: bare (if plain, case-insensitive) or quoted."""
    alts = [_lit(name)] if _PLAIN.match(name) and name.lower() not in _KEYWORDS else []
    for q in _QUOTES[dialect]:
        close = "]" if q == "[" else q
        alts.append(_lit(f"{q}{name}{close}"))
    return alts


def sql_grammar(schema: DatabaseSchema, policy: SQLPolicy | None = None) -> str:
    """The Lark grammar for SELECT queries over `schema` in `policy.dialect`."""
    policy = policy or SQLPolicy()
    dialect = policy.dialect
    tables = [t for t in schema.tables if policy.allowed_tables is None
              or t.lower() in {a.lower() for a in policy.allowed_tables}]
    columns = schema.columns() if policy.allowed_tables is None else list(
        {c.lower(): c for t in tables for c in schema.tables[t]}.values())
    table_alts = sorted({a for t in tables for a in _name_alternatives(t, dialect)})
    column_alts = sorted({a for c in columns for a in _name_alternatives(c, dialect)})
    funcs = [f for f in policy.allowed_functions if f.lower() not in AGGREGATES]
    aggs = [f for f in policy.allowed_functions if f.lower() in AGGREGATES and f.lower() != "count"]
    lines = [_RULES,
             "table: TABLE", "column: COLUMN",
             "TABLE: " + " | ".join(table_alts),
             "COLUMN: " + " | ".join(column_alts),
             "STRING: " + _STRINGS.get(dialect, _DEFAULT_STRING)]
    lines.append("AGG: " + (" | ".join(_lit(f) for f in aggs) if aggs else '"\\u0000never"'))
    lines.append("FUNC: " + (" | ".join(_lit(f) for f in funcs) if funcs else '"\\u0000never"'))
    if "count" in {f.lower() for f in policy.allowed_functions}:
        lines.append('COUNT: "count"i')
    else:
        lines.append('COUNT: "\\u0000never"')
    for kw in _KEYWORDS:
        lines.append(f"{kw.upper()}: {_lit(kw)}")
    return "\n".join(lines) + "\n"


def sql_spec(schema: DatabaseSchema, policy: SQLPolicy | None = None) -> ConstraintSpec:
    return ConstraintSpec(ConstraintKind.SQL, sql_grammar(schema, policy))
