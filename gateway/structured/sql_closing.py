"""Texts that bind what an SQL prefix left unbound, for the Constraint's completion search (closing.py).

The scope guard admits a qualifier before the FROM that declares it (`SELECT t1.max_qty FROM (...) AS
t1`), and after a qualifier FROM has yet to declare, any name: a derived table can carry any column.
So every such prefix stays completable, and this module writes how: per scope with names still
unbound (innermost first), the FROM clause (or the extra FROM sources) that binds them, e.g.
` FROM (SELECT 0 AS max_qty) AS t1`, a table of the schema where one has the columns used. The
completion search tries these texts first, so a model that wrote an invented qualifier can always be
closed inside its token budget.
"""

from __future__ import annotations

from .sql_functions import WINDOW
from .sql_scope import _BARE, SQLScope, _Frame


def _name(scope: SQLScope, name: str) -> str | None:
    """`name` (a table, CTE, alias or column, lower case) as the grammar takes it: bare, or in the
    dialect's first identifier quote (None where neither can be written)."""
    keywords = scope.words.keywords if scope.words is not None else frozenset()
    if _BARE.match(name) and name not in keywords:
        return name
    quote = scope.words.quotes[:1] if scope.words is not None else '"'
    close = "]" if quote == "[" else quote
    return None if not quote or close in name else f"{quote}{name}{close}"


def _alias_ok(scope: SQLScope, name: str) -> bool:
    """A name the grammar takes as a new alias or SELECT-list alias (NEW_NAME: unquoted, no keyword)."""
    keywords = scope.words.keywords if scope.words is not None else frozenset()
    return bool(_BARE.match(name)) and name not in keywords and len(name) <= 32


def _source_for(scope: SQLScope, q: str, cols: set[str]) -> tuple[str, frozenset[str]] | None:
    """A FROM item that declares qualifier `q` with (at least) columns `cols`, and its columns."""
    for src in (q, *scope.tables, *scope.ctes):
        if scope._is_source(src) and cols <= scope._cols(src) and (table := _name(scope, src)) is not None:
            if src == q:
                return table, scope._cols(src)
            return (f"{table} AS {q}", scope._cols(src)) if _alias_ok(scope, q) else None
    if not _alias_ok(scope, q) or not all(_alias_ok(scope, c) for c in cols):
        return None
    return f"(SELECT {', '.join(f'0 AS {c}' for c in sorted(cols)) or '0 AS x'}) AS {q}", frozenset(cols)


def _declarations(scope: SQLScope, f: _Frame) -> list[str] | None:
    """FROM items that bind what scope `f` used before (or in) its FROM and has not bound yet; None
    where no list of new items can (a declared alias lacks a column, a name would be ambiguous)."""
    items, added, used = [], [], set(f.declared)  # FROM texts, the columns each brings, names taken
    for q, cols in f.pending.items():
        src = f.declared.get(q)
        if src is not None:
            if not cols <= scope._cols(src):
                return None
            continue
        found = _source_for(scope, q, cols)
        if found is None:
            return None
        items.append(found[0])
        added.append(found[1])
    for n in sorted(f.bare):
        hits = scope._matches(f, n) + sum(n in cols for cols in added)
        if hits > 1:
            return None
        if hits == 1 or (not scope._matches(f, n) and scope._resolves(f, n)):
            continue
        table = next((t for t in (*scope.tables, *scope.ctes) if n in scope._cols(t)
                      and not any(b in scope._cols(t) for b in f.bare if b != n)), None)
        if table is not None and (text := _name(scope, table)) is not None and table not in used | set(f.pending):
            used.add(table)
            items.append(text)
            added.append(scope._cols(table))
        elif _alias_ok(scope, n):
            alias = next(a for a in (f"d{k}" for k in range(1, 99)) if a not in used | set(f.pending))
            used.add(alias)
            items.append(f"(SELECT 0 AS {n}) AS {alias}")
            added.append(frozenset((n,)))
        else:
            return None
    return items


def closing_texts(scope: SQLScope) -> list[str]:
    """Texts that close the open parentheses and scopes from the innermost out, each scope with the
    FROM clause (` FROM a, b` after a SELECT list, `, a` inside a FROM clause) that binds what it left
    unbound: the longest first (the whole statement where the grammar stands after a complete operand),
    then each shorter prefix of it. Empty inside a string or quoted name and where a scope has not
    begun its SELECT (the search takes those steps first)."""
    return _closing(scope)[0]


def closing_text(scope: SQLScope) -> str | None:
    """The text that closes every open scope and parenthesis ("" where none is open), or None where
    closing_texts cannot write one (a scope not begun, a name no FROM item can bind, inside quotes)."""
    texts, whole = _closing(scope)
    return (texts[0] if texts else "") if whole else None


def _closing(scope: SQLScope) -> tuple[list[str], bool]:
    """closing_texts, and whether the longest of them closes the whole statement."""
    suffix = _quote_end(scope)
    if suffix is None:
        return [], False
    texts = []
    queried = False  # the scope below has its query written (by a CTE's `) SELECT 0`)
    for i in range(len(scope.stack) - 1, -1, -1):
        f = scope.stack[i]
        if f.scope and f.phase == "start" and not queried:
            if (rest := _WITH_END.get(f.with_state)) is None:
                return texts[::-1], False
            cte = next(n for n in (f"c{k}" for k in range(1, 1000)) if n not in scope.ctes)
            suffix += rest.format(cte=cte)
        elif f.fresh and not f.scope and not f.func:  # nothing inside yet: a query (a value in an aggregate's)
            suffix += "" if f.over else "0" if f.call else "SELECT 0"
        if f.scope and (f.pending or f.bare) and f.phase in ("select", "from"):
            items = _declarations(scope, f)
            if items is None:
                return texts[::-1], False
            if items:
                suffix += (" FROM " if f.phase == "select" else ", ") + ", ".join(items)
        if i:
            suffix += ") SELECT 0" if f.cte is not None else _call_end(scope, f) if f.func else ")"
        if suffix and (not texts or texts[-1] != suffix):
            texts.append(suffix)
        queried = f.cte is not None
    return texts[::-1], True


# what ends a WITH clause, by where it stands (SQLScope._with_word): a CTE's name is next, its AS, its body, the query
_WITH_END = {"name": " {cte} AS (SELECT 0) SELECT 0", "as": " AS (SELECT 0) SELECT 0", "body": " (SELECT 0) SELECT 0",
             "after": " SELECT 0"}


def _quote_end(scope: SQLScope) -> str | None:
    """The text that ends the string literal being written ("" outside one); None inside a quoted name (its
    name is checked as it is written: the search writes it)."""
    if not scope.mode:
        return ""
    if scope.mode == scope.string or (scope.words is not None and scope.pool is None and scope.word
                                      and scope.mode in scope.words.strings):
        return scope.mode  # (SQLite's "...": a string where it is not a column or a source)
    return None


def _call_end(scope: SQLScope, f: _Frame) -> str:
    """`)` of a call with arity `f.func`: the arguments it still needs first (`, 0`; `0` where the one begun is
    empty), and OVER () after a window function's (the grammar requires it; the scope guard refuses too few
    arguments)."""
    need = max(0, (scope.words.arity[f.func][0] if scope.words is not None else 0) - f.args)
    empty = f is scope.stack[-1] and not scope.word and scope.at in ("(", ",")  # (after "," args counts it)
    zeros = ["0"] * (need + (1 if empty and f.args else 0))
    text = (", ".join(zeros) if empty else "".join(", " + z for z in zeros)) + ")"
    return text + " OVER ()" if f.func in WINDOW else text
