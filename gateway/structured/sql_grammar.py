"""A Lark grammar (llguidance dialect) for read-only SELECT over one caller's database schema.

Tables and columns are literal terminals, so only real names can be produced; aliases and CTE
names are new identifiers that are not keywords; a CTE is named `cte_*` so that FROM can name it
without letting the model invent table names (sqlglot then checks it is bound). Keywords and
unquoted names are case-insensitive. Whitespace is explicit and bounded: two word tokens never
touch, and each gap holds 1-4 whitespace bytes; two minus signs never touch (`--` starts a comment).

A CFG cannot bind `T1.name` in the SELECT list to the `FROM t AS T1` after it: the grammar ends with
comments listing the tables and their columns and the grammar's words, from which the Constraint
builds the alias-binding guard (sql_scope.py) that vetoes unbound qualifiers while decoding (and
words that could only go on as one).
"""

from __future__ import annotations

import functools
import json
import re

from sqlglot import exp
from sqlglot.dialects.dialect import Dialect, NormalizationStrategy

from .base import ConstraintKind, ConstraintSpec
from .sql_functions import AGGREGATES, WINDOW, signature
from .sql_schema import DatabaseSchema, SQLPolicy
from .sql_scope import SCHEMA_COMMENT, WORDS_COMMENT

# Identifier quoting per dialect; string literals are bounded (no backslash, no control bytes, at most
# _MAX_STRING characters: a model cannot loop on `''` or run a literal to the token limit).
_QUOTES = {
    "sqlite": ('"', "`", "["),
    "postgres": ('"',),
    "duckdb": ('"',),
    "snowflake": ('"',),
    "mysql": ("`",),
    "bigquery": ("`",),
}
_MAX_STRING = 64
_STRING_CHAR = r"[^'\\\x00-\x1f]"
_STRINGS = {  # SQLite and MySQL also read "..." as a string (the validator rewrites SQLite's to '...')
    "sqlite": rf"""/'({_STRING_CHAR}|''){{0,{_MAX_STRING}}}'/ | /"[^"\\\x00-\x1f]{{1,{_MAX_STRING}}}"/""",
    "mysql": rf"""/'({_STRING_CHAR}|''){{0,{_MAX_STRING}}}'/ | /"[^"\\\x00-\x1f]{{1,{_MAX_STRING}}}"/""",
}
_DEFAULT_STRING = rf"""/'({_STRING_CHAR}|''){{0,{_MAX_STRING}}}'/"""
_TYPES = ("integer", "int", "bigint", "real", "float", "double", "text", "numeric", "decimal", "date",
          "datetime", "timestamp", "varchar", "char", "boolean")
_PLAIN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# SQLite and MySQL also write LIMIT offset, count
_LIMIT_COMMA = ("sqlite", "mysql")
# Functions sqlglot parses with a syntax of their own (SUBSTRING(x FROM n), TRIM(BOTH c FROM x), DATE_PART): their
# arguments are values, not predicates (`trim(a = 1)` does not parse); the scope guard's word check knows them too
VALUE_ARGS = ("substring", "trim", "date_part")

_KEYWORDS = (
    "select", "distinct", "from", "where", "group", "by", "having", "order", "limit", "offset",
    "asc", "desc", "join", "inner", "left", "right", "full", "outer", "cross", "on", "using",
    "and", "or", "not", "in", "is", "null", "like", "between", "exists", "as", "union", "all",
    "intersect", "except", "with", "case", "when", "then", "else", "end", "cast", "true", "false",
    "over", "partition", "rows", "range", "unbounded", "preceding", "following", "current", "row",
    "nulls", "first", "last", "window", "filter", "natural", "glob",
)

# For the scope guard's word check (sql_scope.py), written into the grammar after WORDS_COMMENT: the
# tokens after which an operand starts (there a new name may begin a qualifier), the keywords that
# may start an operand, and those that may also start one right after a given token.
_BEFORE_OPERAND = ("where", "on", "and", "or", "not", "by", "having", "when", "then", "else", "case",
                   "like", "between", "distinct", "select", "(", ",", "=", "<", ">", "!", "+", "-", "*", "/",
                   "%", "|")
_OPERAND_KEYWORDS = ("not", "exists", "case", "cast", "null", "true", "false")
_OPERAND_AFTER = {"(": ("select", "with", "distinct", "partition", "order", "rows", "range"),
                  "case": ("when",), "not": ("in", "between", "like", "exists"),
                  "select": ("distinct",), "between": ("unbounded", "current"), "and": ("unbounded", "current")}

SQL_START = 'start: query (_O? ";")?'
_RULES = r"""
start: query (_O? ";")?
query: (with_clause _O?)? compound (_S order_by)? (_S limit_clause)?
with_clause: WITH _S cte (_O? "," _O? cte)*
cte: NEW_NAME _S AS _O? "(" _O? query _O? ")"
compound: select_core (_S set_op _S select_core)*
set_op: UNION (_S ALL)? | INTERSECT | EXCEPT
select_core: SELECT (_S DISTINCT)? _S select_list (_S from_clause)? (_S where_clause)? (_S group_by)? (_S having)?
select_list: select_item (_O? "," _O? select_item)*
select_item: "*" | qualifier "." "*" | expr (_S (AS _S)? NEW_NAME)?
from_clause: FROM _S source (_S join | _O? "," _O? source)*
source: (table | NEW_NAME) (_S (AS _S)? NEW_NAME)? | "(" _O? query _O? ")" (_O? (AS _S)? NEW_NAME)?
join: (join_kind _S)? JOIN _S source (_S ON _S expr | _S USING _O? "(" _O? column (_O? "," _O? column)* _O? ")")?
join_kind: INNER | CROSS | LEFT (_S OUTER)? | RIGHT (_S OUTER)? | FULL (_S OUTER)?
where_clause: WHERE _S expr
group_by: GROUP _S BY _S group_item (_O? "," _O? group_item)*
group_item: expr | OUTPUT_NAME
having: HAVING _S (expr | OUTPUT_NAME _O? COMP _O? sum_expr)
order_by: ORDER _S BY _S order_item (_O? "," _O? order_item)*
order_item: (expr | OUTPUT_NAME) (_S (ASC | DESC))? (_S NULLS _S (FIRST | LAST))?

expr: and_expr (_S OR _S and_expr)*
and_expr: not_expr (_S AND _S not_expr)*
not_expr: NOT _S not_expr | predicate
predicate: sum_expr
    | sum_expr _O? COMP _O? sum_expr
    | sum_expr (_S NOT)? _S IN _O? "(" _O? (query | expr_list) _O? ")"
    | sum_expr (_S NOT)? _S BETWEEN _S sum_expr _S AND _S sum_expr
    | sum_expr (_S NOT)? _S LIKE _S sum_expr
    | sum_expr _S IS (_S NOT)? _S NULL
    | EXISTS _O? "(" _O? query _O? ")"
sum_expr: term (_O? ADD_OP _O? term | _O? "-" (_O? unsigned_term | _S term))*
term: factor (_O? MUL_OP _O? factor)*
unsigned_term: primary (_O? MUL_OP _O? factor)*
factor: "-" _O? primary | primary
primary: literal | column_ref | call | "(" _O? expr _O? ")" | "(" _O? query _O? ")" | case_expr
    | CAST _O? "(" _O? expr _S AS _S TYPE_NAME _O? ")"
case_expr: CASE (_S expr)? (_S WHEN _S expr _S THEN _S expr)+ (_S ELSE _S expr)? _S END
expr_list: expr (_O? "," _O? expr)*
call: (AGG | COUNT) _O? "(" _O? (DISTINCT _S)? expr _O? ")" over? | COUNT _O? "(" _O? "*" _O? ")" over?
    | funcs
over: _S OVER _O? "(" _O? window_spec? _O? ")"
window_spec: partition (_S order_by)? (_S frame)? | order_by (_S frame)? | frame
partition: PARTITION _S BY _S expr (_O? "," _O? expr)*
frame: (ROWS | RANGE) _S (BETWEEN _S bound _S AND _S bound | bound)
bound: UNBOUNDED _S (PRECEDING | FOLLOWING) | CURRENT _S ROW | INT _S (PRECEDING | FOLLOWING)
column_ref: column | qualifier "." (column | NEW_NAME)
column: COLUMN
qualifier: table | NEW_NAME
literal: NUMBER | STRING | NULL | TRUE | FALSE

// Whitespace is explicit: _S between two tokens that may both be words (so words never touch),
// _O where one side is punctuation. Each gap holds at most 4 whitespace bytes.
_S: /[ \t\r\n]{1,4}/
_O: /[ \t\r\n]{1,4}/
COMP: "=" | "!=" | "<>" | "<" | ">" | "<=" | ">="
ADD_OP: "+" | "||"
MUL_OP: "*" | "/" | "%"
INT: /[0-9]{1,9}/
NUMBER: /[0-9]{1,18}(\.[0-9]{1,18})?/ | /\.[0-9]{1,18}/
"""


_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
_ID_FIRST = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_")


def _char_class(chars: set[str] | frozenset[str]) -> str:
    """A regex class listing exactly `chars` (alnum and _ only), as ranges where possible."""
    codes = sorted(ord(c) for c in chars)
    parts, i = [], 0
    while i < len(codes):
        j = i
        while j + 1 < len(codes) and codes[j + 1] == codes[j] + 1:
            j += 1
        parts.append(chr(codes[i]) if i == j else f"{chr(codes[i])}-{chr(codes[j])}")
        i = j + 1
    return "[" + "".join(parts) + "]"


@functools.lru_cache(maxsize=64)
def _identifier_except(words: tuple[str, ...], max_len: int = 32) -> str:
    """Regex of identifiers ([A-Za-z_][A-Za-z0-9_]{0,max_len-1}) whose lower case is not in `words`
    (cached: the keywords and a policy's functions, not the schema, decide it)."""
    trie: dict = {}
    for w in words:
        node = trie
        for ch in w.lower():
            node = node.setdefault(ch, {})
        node[""] = {}

    def below(node: dict, depth: int) -> str:
        alts = []
        if depth and "" not in node:
            alts.append("")  # a proper prefix of a keyword is an identifier
        kids = [c for c in node if c]
        for c in kids:
            cls = _char_class({c, c.upper()}) if c.isalpha() else c
            alts.append(cls + below(node[c], depth + 1))
        pool = (_ID_FIRST if depth == 0 else _ID_CHARS) - {k for c in kids for k in (c, c.upper())}
        alts.append(_char_class(pool) + _char_class(_ID_CHARS) + f"{{0,{max_len - depth - 1}}}")
        return "(" + "|".join(alts) + ")"

    return below(trie, 0)


def _lit(text: str, insensitive: bool = True) -> str:
    """A terminal for `text`; case-insensitive over ASCII only (a Unicode-folding `"..."i` would
    let e.g. U+017F 'ſ' stand for 's')."""
    if not insensitive or not any(c.isalpha() for c in text):
        return json.dumps(text)
    body = "".join(_char_class({c.lower(), c.upper()}) if c.isascii() and c.isalpha() else re.escape(c)
                   for c in text)
    return "/" + body.replace("/", "\\/") + "/"


def _name_alternatives(name: str, dialect: str) -> list[str]:
    """Every way to write one table/column name so that sqlglot resolves it against the schema: bare
    (if plain and not a keyword; case-insensitive unless the dialect is case-sensitive) or quoted
    (the name as the dialect normalises it: any case where the dialect folds quoted names too)."""
    d = Dialect.get_or_raise(dialect)
    folds = d.NORMALIZATION_STRATEGY is not NormalizationStrategy.CASE_SENSITIVE
    alts = [_lit(name, folds)] if _PLAIN.match(name) and name.lower() not in _KEYWORDS else []
    normal = d.normalize_identifier(exp.to_identifier(name)).name
    for q in _QUOTES[dialect]:
        close = "]" if q == "[" else q
        if close in name:
            continue
        alts.append(_lit(f"{q}{normal}{close}", d.NORMALIZATION_STRATEGY is NormalizationStrategy.CASE_INSENSITIVE))
    return alts


def _function_rules(functions: tuple[str, ...], dialect: str) -> tuple[list[str], dict[str, list]]:
    """`funcs` (calls without arguments, window functions with OVER, the rest) and each function's
    argument counts from sqlglot's parser for `dialect` (the scope guard enforces them: per-arity
    grammar rules multiply the parser's items past llguidance's limits)."""
    groups: dict[str, list[str]] = {"FUNC_NONE": [], "FUNC_WINDOW": [], "FUNC_VALUE": [], "FUNC": []}
    arity: dict[str, list] = {}
    for f in functions:
        sig = signature(dialect, f)
        if f in AGGREGATES or sig is None or not _PLAIN.match(f) or f.lower() in _KEYWORDS:
            continue
        arity[f] = list(sig)
        groups["FUNC_NONE" if sig == (0, 0) else "FUNC_WINDOW" if f in WINDOW
               else "FUNC_VALUE" if f.lower() in VALUE_ARGS else "FUNC"].append(f)
    rules = {"FUNC_NONE": 'FUNC_NONE _O? "(" _O? ")"',
             "FUNC_WINDOW": 'FUNC_WINDOW _O? "(" _O? expr_list? _O? ")" over',
             "FUNC_VALUE": 'FUNC_VALUE _O? "(" _O? sum_expr (_O? "," _O? sum_expr)* _O? ")"',
             "FUNC": 'FUNC _O? "(" _O? expr_list? _O? ")"'}
    lines = ["funcs: " + " | ".join(rules[g] for g, names in groups.items() if names)] if any(groups.values()) else []
    lines += [f"{g}: " + " | ".join(_lit(n) for n in sorted(names)) for g, names in groups.items() if names]
    return lines, arity


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
    functions = policy.functions
    aggs = [f for f in functions if f in AGGREGATES and f != "count"]
    rules = _RULES
    if dialect in _LIMIT_COMMA:
        rules += "limit_clause: LIMIT _S INT (_S OFFSET _S INT | _O? \",\" _O? INT)?\n"
    else:
        rules += "limit_clause: LIMIT _S INT (_S OFFSET _S INT)?\n"
    lines = [rules,
             f"NEW_NAME: /{_identifier_except(_KEYWORDS)}/",
             # GROUP BY / ORDER BY may name a SELECT-list alias (the scope guard checks that it is one)
             f"OUTPUT_NAME: /{_identifier_except(_KEYWORDS + tuple(functions))}/",
             "TYPE_NAME: " + " | ".join(_lit(t) for t in _TYPES),
             "table: TABLE",
             "TABLE: " + " | ".join(table_alts),
             "COLUMN: " + " | ".join(column_alts),
             "STRING: " + _STRINGS.get(dialect, _DEFAULT_STRING)]
    lines.append("AGG: " + (" | ".join(_lit(f) for f in aggs) if aggs else '"\\u0000never"'))
    func_lines, arity = _function_rules(functions, dialect)
    lines += func_lines
    if not func_lines:  # an allow-list of aggregates alone: no other call (an empty `funcs` would match nothing written)
        lines[0] = lines[0].replace("\n    | funcs\n", "\n")
    lines.append('COUNT: "count"i' if "count" in functions else 'COUNT: "\\u0000never"')
    for kw in _KEYWORDS:
        lines.append(f"{kw.upper()}: {_lit(kw)}")
    # The tables and columns for the alias-binding guard (sql_scope.py); a comment to the grammar.
    lines.append(SCHEMA_COMMENT + json.dumps({t: list(schema.tables[t]) for t in tables}))
    lines.append(WORDS_COMMENT + json.dumps({
        "keywords": _KEYWORDS, "functions": list(functions),
        "before_operand": _BEFORE_OPERAND, "operand": _OPERAND_KEYWORDS,
        "after": _OPERAND_AFTER, "quotes": "".join(_QUOTES[dialect]),
        "strings": "'" + ('"' if dialect in _STRINGS else ""), "arity": arity, "value_args": VALUE_ARGS}))
    return "\n".join(lines) + "\n"


def sql_spec(schema: DatabaseSchema, policy: SQLPolicy | None = None) -> ConstraintSpec:
    return ConstraintSpec(ConstraintKind.SQL, sql_grammar(schema, policy))
