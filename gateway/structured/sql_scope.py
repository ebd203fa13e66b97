"""Name binding for SQL decoding: a scope tracker over the generated text that vetoes tokens which
would leave a name unbound (PICARD-style incremental checks on top of the Lark grammar).

A CFG cannot tie `T1.name` in a SELECT list to the `FROM singer AS T1` that comes after it, so the
grammar admits any alias and this guard binds them while decoding:

- a qualifier (`q.`) must name an alias/table declared by the current or an enclosing scope, or
  else is recorded as *pending* in the innermost scope still in its SELECT list (none: veto; never a
  WITH clause's statement, whose FROM a CTE body cannot see);
- the column after `q.` must be a column of q's table, checked on every character (a pending
  qualifier that is not a table's name: a column of some table, CTE or derived table known so far);
- an unqualified name in a SELECT list before its FROM must be a column of some table, CTE or
  derived table known so far; it is recorded and must resolve to exactly one source of the scope
  (or an enclosing one) once FROM ends, and a FROM source that would make it ambiguous is refused;
- a FROM clause can only end (WHERE/GROUP/ORDER/LIMIT/HAVING/set operator/`)`/`;`/EOS) once every
  pending name of its scope is bound; while one is not, a word after a complete operand cannot start
  as a clause keyword (so the model is never left half-way into a keyword it may not finish);
- a FROM source is a table, or a CTE declared by WITH; CTEs and derived tables have the columns their
  first SELECT list names (aliases, column names, `*` expanded), tracked like tables;
- where every qualifier must already be bound (no scope before its FROM) and a word starts an operand,
  an unquoted word must stay a prefix of a word that can be written there: an unambiguous column of
  the sources in scope, a bound alias/table (as a qualifier), in GROUP BY/HAVING/ORDER BY a SELECT-list
  alias, a function, or a keyword that can start an operand there.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

from .sql_budget import ANY, SCHEMA, ClosingBudget

SCHEMA_COMMENT = "// moegate-sql-tables: "  # sql_grammar.py writes the tables it allows after this
WORDS_COMMENT = "// moegate-sql-words: "  # and its keywords, functions and operand positions after this
_ID = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
_CLAUSE_END = frozenset(("where", "group", "having", "order", "limit", "union", "intersect", "except"))
_JOIN_WORDS = frozenset(("inner", "left", "right", "full", "outer", "cross", "natural"))
_QUOTE_CLOSE = {'"': '"', "`": "`", "[": "]"}
_BARE = re.compile(r"[a-z_][a-z0-9_]*\Z")  # a name the grammar takes unquoted (unless a keyword)
_AFTER_SOURCE = frozenset(("join", "inner", "left", "right", "full", "cross", "on", "using", "where", "group",
                           "having", "order", "limit", "union", "intersect", "except"))
_WINDOW_WORDS = frozenset(("partition", "order", "rows", "range"))  # after "(" only in OVER (...)
_AFTER_ALIAS = frozenset(("from",))
# after a FROM source's alias: a join (the grammar's join kinds), and ON / USING only where that source was joined
_AFTER_SOURCE_ALIAS = frozenset(("inner", "left", "right", "full", "cross", "join"))
_AFTER_USING = _AFTER_SOURCE_ALIAS
_QUERY_WORDS = frozenset(("select", "with", "values"))
# after an arithmetic or comparison operator, LIKE or BETWEEN the grammar wants a sum_expr: no NOT / EXISTS there
_IN_SUM = frozenset(("=", "<", ">", "!", "+", "-", "*", "/", "%", "|", "like", "between"))
_PREDICATE_WORDS = frozenset(("not", "exists"))
_BANNED = ("where", "group", "having", "order", "limit", "union", "intersect", "except", "offset")


@functools.lru_cache(maxsize=4096)
def _bare(names: frozenset[str], keywords: frozenset[str]) -> frozenset[str]:
    """The names that the grammar takes unquoted."""
    return frozenset(n for n in names if _BARE.match(n) and n not in keywords)


@dataclass
class _Frame:
    scope: bool  # a SELECT scope, or a plain parenthesis
    fresh: bool = True  # nothing inside yet (a paren becomes a scope when SELECT/WITH follows)
    source: bool = False  # opened where FROM expects a source (a derived table)
    cte: str | None = None  # opened as the body of this CTE
    phase: str = "start"  # start | select | from | after
    expect: str = "source"  # in FROM: source | after_source | alias | aliased | on | using
    declared: dict[str, str] = field(default_factory=dict)  # alias -> source (table, CTE or "#n" derived)
    pending: dict[str, set[str]] = field(default_factory=dict)  # qualifier -> columns used before FROM
    bare: set[str] = field(default_factory=set)  # unqualified names used before FROM
    source_name: str | None = None  # the last FROM source awaiting an alias
    source_own: bool = False  # that source's own name entered `declared` with it (not already there)
    aliases: set[str] = field(default_factory=set)  # the aliases its SELECT lists give
    clause: str = ""  # the last clause keyword of the scope (where, group, having, order, limit, union...)
    item: list[tuple[str, str]] = field(default_factory=list)  # the SELECT item being written: (kind, text)
    names: list[str] = field(default_factory=list)  # output names of its first SELECT ("*" / "q.*": stars)
    first: bool = True  # in its first SELECT (its output columns are that list's)
    outputs: frozenset[str] | None = None  # its output columns, once the first SELECT ended
    with_state: str = ""  # in WITH: name (a CTE name is next) | as | body | after
    over: bool = False  # the parenthesis of a window (OVER (...))
    func: str = ""  # the parenthesis of this function's arguments
    call: bool = False  # the parenthesis of any call's arguments (an aggregate's too: no arity kept for those)
    joined: bool = False  # in FROM: the source being read came after JOIN (so ON / USING may follow it)
    args: int = 0  # arguments begun so far
    items: int = 0  # items of its current SELECT list that ended

    def clone(self) -> _Frame:
        new = object.__new__(_Frame)
        d = new.__dict__
        d.update(self.__dict__)
        d["declared"], d["pending"] = dict(self.declared), {q: set(c) for q, c in self.pending.items()}
        d["bare"], d["aliases"], d["item"], d["names"] = set(self.bare), set(self.aliases), list(self.item), list(self.names)
        return new


@dataclass(frozen=True)
class SQLWords:
    """The grammar's words for the word check (from its WORDS_COMMENT line)."""

    keywords: frozenset[str]
    functions: frozenset[str]
    before_operand: frozenset[str]  # a word or punctuation after which an operand starts
    operand: frozenset[str]  # keywords and functions that may start an operand
    after: dict[str, frozenset[str]]  # keywords that may also start one right after a word/punctuation
    arity: dict[str, tuple[int, int | None]] = field(default_factory=dict)  # function -> (least, most) arguments
    quotes: str = '"`['  # characters that open a quoted name
    strings: str = "'"  # characters that open a string literal (in both: either, e.g. SQLite's ")
    value_args: frozenset[str] = frozenset()  # functions whose arguments are values, not predicates

    @classmethod
    def from_json(cls, d: dict) -> SQLWords:
        functions, keywords = frozenset(d["functions"]), frozenset(d["keywords"])
        # (a function named like a keyword, e.g. Postgres' RIGHT, is no call in the grammar: not an operand)
        return cls(keywords, functions, frozenset(d["before_operand"]),
                   frozenset(d["operand"]) | (functions - keywords), {k: frozenset(v) for k, v in d["after"].items()},
                   {f: tuple(a) for f, a in d.get("arity", {}).items()}, d.get("quotes", '"`['), d.get("strings", "'"),
                   frozenset(d.get("value_args", ())))


@dataclass(frozen=True)
class WordPool:
    """The words an operand may be where a word starts: `ends` may end there, `quals` only before a `.`."""

    ends: frozenset[str]
    quals: frozenset[str]

    @functools.cached_property
    def words(self) -> frozenset[str]:
        return self.ends | self.quals

    def admits(self, prefix: str) -> bool:
        return any(w.startswith(prefix) for w in self.words)


class _Veto(Exception):
    """A token the scope guard refuses (raised inside feed, caught by the callers)."""


class SQLScope:
    """Scope state over the text so far; `feed` raises _Veto on the first unbindable construct."""

    def __init__(self, tables: dict[str, frozenset[str]], fenced: bool, words: SQLWords | None = None) -> None:
        self.tables, self.fenced, self.words = tables, fenced, words
        self.stack = [_Frame(scope=True)]
        self.mode = ""  # "" normal, "'" string, or a quote's closing char (quoted identifier)
        self.string = ""  # the quote of the string literal being written
        self.word, self.quoted = "", False
        self.last: str | None = None  # the word that the current character ended
        self.dot_q: str | None = None  # qualifier of the column being written
        self.prev = ""
        self.at = ""  # the last word (lower case, unquoted) or punctuation; "" after a value
        self.word_at = ""  # `at` where the word being written started
        self.pool: WordPool | None = None  # what the word being written may become (None: unchecked)
        self.banned: tuple[str, ...] = ()  # clause keywords the word being written may not become
        self.derived: dict[str, frozenset[str]] = {}  # CTE names and "#n" derived tables -> columns
        self.ctes: set[str] = set()
        self.done = False  # the statement ended (the closing fence of a segment)
        # the token budget (sql_budget.py): tokens the output may still take (None: no limit), and the rule
        self.left: int | None = None
        self.budget: ClosingBudget | None = None
        self.dot_limit: frozenset[str] | None = None  # the columns `q.` may go on with where the budget narrows them
        self.word_tier = ANY  # the budget's tier where the last word started (its qualifier keeps it)

    def clone(self) -> SQLScope:
        new = object.__new__(SQLScope)
        new.__dict__.update(self.__dict__)
        new.stack = [f.clone() for f in self.stack]
        new.derived = dict(self.derived)
        new.ctes = set(self.ctes)
        return new

    # -- scopes ----------------------------------------------------------------------------
    def _scope(self) -> _Frame:
        return next(f for f in reversed(self.stack) if f.scope)

    def _cols(self, source: str) -> frozenset[str]:
        return self.tables.get(source) or self.derived.get(source, frozenset())

    def _is_column(self, name: str) -> bool:
        """A column of some table, CTE or derived table (SQLite reads any other "..." as a string)."""
        return any(name in cols for cols in self.tables.values()) or any(name in c for c in self.derived.values())

    def _all_columns(self) -> frozenset[str]:
        return frozenset().union(*self.tables.values(), *self.derived.values())

    def _is_source(self, name: str) -> bool:
        return name in self.tables or name in self.ctes

    def _at_source(self) -> bool:
        """Where FROM expects a source: a double-quoted word there names a table (SQLite reads it as a string
        only where a value may stand)."""
        f = self._scope()
        return f.phase == "from" and f.expect == "source" and self.stack[-1] is f and f.with_state in ("", "after")

    def _lookup(self, q: str) -> str | None:
        for f in reversed(self.stack):
            if f.scope and q in f.declared:
                return f.declared[q]
        return None

    def _matches(self, f: _Frame, name: str) -> int:
        """How many sources of scope `f` have a column `name`."""
        return sum(name in self._cols(src) for src in f.declared.values())

    def _resolves(self, f: _Frame, name: str) -> bool:
        """An unqualified `name` in scope `f` names one column: of one of f's sources, or (none there)
        of an enclosing scope's."""
        n = self._matches(f, name)
        if n:
            return n == 1
        return any(name in self._cols(src) for g in self.stack if g.scope and g is not f for src in g.declared.values())

    def _unbound(self, f: _Frame) -> bool:
        """Names used before FROM that FROM has not bound (yet)."""
        for q, cols in f.pending.items():
            src = f.declared.get(q)
            if src is None or not cols <= self._cols(src):
                return True
        return any(not self._resolves(f, n) for n in f.bare)

    def _end_from(self, f: _Frame) -> None:
        for q, cols in f.pending.items():
            src = f.declared.get(q)
            if src is None or not cols <= self._cols(src):
                raise _Veto(f"qualifier {q} is not bound by FROM")
        for n in f.bare:
            if not self._resolves(f, n):
                raise _Veto(f"{n} is not one column of the FROM clause")
        f.pending.clear()
        f.bare.clear()
        f.phase = "after"

    def _end_scope(self, f: _Frame) -> None:
        if f.phase == "select" and self.stack[-1] is f:
            self._finish_item(f)
        if f.phase == "from":
            self._end_from(f)
        elif f.pending or f.bare:
            raise _Veto("names used without a FROM clause")
        else:
            f.phase = "after"  # (no FROM can follow: later names must be bound already)
        self._end_first(f)

    def _end_first(self, f: _Frame) -> None:
        """The first SELECT of `f` ended: its output columns are known."""
        if not f.first:
            return
        f.first = False
        cols = set()
        for n in f.names:
            if n == "*":
                cols |= {c for src in f.declared.values() for c in self._cols(src)}
            elif n.endswith(".*"):
                cols |= self._cols(self._lookup(n[:-2]) or "")
            else:
                cols.add(n)
        f.outputs = frozenset(cols)

    def end(self) -> None:
        """The statement ends here (EOS, `;`, the closing fence)."""
        if self.word and not self.mode:
            self._complete(quoted=False, follow="")
        for f in self.stack:
            if f.scope:
                self._end_scope(f)

    def _declare(self, f: _Frame, alias: str) -> None:
        src = f.source_name
        if src is None:
            return
        if f.source_own:
            if alias == src:  # a table aliased by its own name keeps it
                return
            if src in f.pending:
                raise _Veto(f"table {src} is used as a qualifier: it cannot take an alias")
            del f.declared[src]
        if alias in f.declared:  # (sqlglot: "Alias already used"; a table's own name counts as its alias)
            raise _Veto(f"alias {alias} is already used in this FROM")
        if alias in f.pending and not f.pending[alias] <= self._cols(src):
            raise _Veto(f"alias {alias} is used with columns that {src} does not have")
        f.declared[alias] = src

    def _add_source(self, f: _Frame, src: str, name: str) -> None:
        """A FROM source; refused where it would make a name used before FROM ambiguous."""
        cols = self._cols(src)
        for n in f.bare:
            if n in cols and self._matches(f, n):
                raise _Veto(f"{name} would make {n} ambiguous")
        f.source_name, f.source_own = src, name not in f.declared
        f.declared[name] = src

    # -- SELECT items (output columns of CTEs and derived tables) ----------------------------
    def _finish_item(self, f: _Frame) -> None:
        parts, f.item = f.item, []
        f.items += bool(parts)
        while parts and parts[0] == ("k", "distinct") or parts[:1] == [("k", "all")]:
            parts = parts[1:]
        name, alias = None, False
        texts = [t for _, t in parts]
        if texts == ["*"]:
            name = "*"
        elif len(parts) == 3 and texts[1:] == [".", "*"]:
            name = texts[0] + ".*"
        elif len(parts) >= 2 and parts[-2] == ("k", "as") and parts[-1][0] == "w":
            name, alias = texts[-1], True
        elif len(parts) == 1 and parts[0][0] == "w":
            name = texts[0]
        elif len(parts) == 3 and texts[1] == "." and parts[2][0] == "w":
            name = texts[2]
        elif len(parts) >= 2 and parts[-1][0] == "w" and (parts[-2][0] in "wv" or texts[-2] == ")"):
            name, alias = texts[-1], True
        if alias:
            f.aliases.add(name)
        if f.first and name is not None:
            f.names.append(name)

    def _item(self, f: _Frame, kind: str, text: str) -> None:
        if f.phase == "select" and self.stack[-1] is f:
            f.item.append((kind, text))

    # -- words -----------------------------------------------------------------------------
    def _word(self, w: str, quoted: bool, follow: str) -> None:
        kw = "" if quoted or w not in self._keywords() else w
        before, self.at = self.at, (w if not quoted else "")
        f = self._scope()
        if self.dot_q is not None:  # the column of a qualified reference (checked as it was typed)
            q, self.dot_q = self.dot_q, None
            self._column(q, w, final=True, quoted=quoted)
            self._item(f, "w", w)
            self.last, self.at = None, ""
            return
        top = self.stack[-1]
        if not top.scope and top.fresh and kw in ("select", "with"):
            top.scope = True
            f = top
        top.fresh = False
        level = self.stack[-1] is f
        if level and self._with_word(f, w, kw):
            self.last = w
            return
        if kw in _CLAUSE_END and level:
            f.clause = kw
        if f.phase == "select" and level and kw in ("from",) + tuple(_CLAUSE_END):
            self._finish_item(f)
        if kw and kw not in ("from",) and not (kw in _CLAUSE_END and level):
            self._item(f, "v" if kw in ("end", "null", "true", "false") else "k", kw)
        elif not kw and follow not in (".", "("):
            self._item(f, "w", w)
        if not kw and follow not in (".", "(") and before in self._before_operand() and w not in self._functions() \
                and not (f.phase == "from" and f.expect in ("source", "after_source", "alias", "using") and level):
            self._name(f, w)
        if kw == "select":
            if f.phase != "start":
                self._end_scope(f)
            f.phase, f.declared, f.pending, f.bare, f.expect, f.items = "select", {}, {}, set(), "source", 0
            f.with_state = ""
        elif kw == "from" and f.phase == "select":
            f.phase, f.expect, f.joined = "from", "source", False
        elif kw in _CLAUSE_END and f.phase in ("select", "from") and level:
            self._end_scope(f)
        elif kw in ("union", "intersect", "except") and level:
            self._end_first(f)
        elif f.phase == "from" and level:
            self._from_word(f, w, kw)
        self.last = w

    def _with_word(self, f: _Frame, w: str, kw: str) -> bool:
        """WITH name AS (...), ...: records CTE names; True where the word was one of the clause's."""
        if kw == "with" and f.phase == "start":
            f.with_state = "name"
            return True
        if f.with_state == "name":
            f.with_state = "as"
            f.source_name = w  # the CTE being declared
            return True
        if f.with_state == "as" and kw == "as":
            f.with_state = "body"
            return True
        return False

    def _keywords(self) -> frozenset[str]:
        return self.words.keywords if self.words is not None else frozenset()

    def _functions(self) -> frozenset[str]:
        return self.words.functions if self.words is not None else frozenset()

    def _before_operand(self) -> frozenset[str]:
        return self.words.before_operand if self.words is not None else frozenset()

    def _name(self, f: _Frame, w: str) -> None:
        """An unqualified column (or, in GROUP BY/HAVING/ORDER BY, a SELECT-list alias) as an operand."""
        if f.phase == "from" and f.expect == "using":
            return  # USING (c): a column of both sides
        if f.phase == "select":
            f.bare.add(w)
        elif self._resolves(f, w) or (f.clause in ("group", "having", "order") and w in f.aliases):
            return
        elif not self._matches(f, w) and (host := self._host()) is not None:
            host.bare.add(w)  # a column of an enclosing scope whose FROM is still to come
        else:
            raise _Veto(f"{w} is not one column of the tables in scope")

    def _from_word(self, f: _Frame, w: str, kw: str) -> None:
        if f.expect == "source":
            if not self._is_source(w):
                raise _Veto(f"{w} is not a table or a CTE")
            self._add_source(f, w, w)
            f.expect = "after_source"
        elif kw == "join":
            f.expect, f.joined = "source", True
        elif kw in ("on", "using") and f.expect in ("after_source", "aliased"):
            f.expect = kw  # (USING names a column of both sides)
        elif f.expect in ("on", "using", "aliased") or kw in _JOIN_WORDS:
            return
        elif kw == "as" and f.expect == "after_source":
            f.expect = "alias"
        elif f.expect in ("alias", "after_source"):
            self._declare(f, w)
            f.expect, f.source_name = "aliased", None  # nothing but a join, ON/USING or an end may follow

    def _column(self, q: str, col: str, final: bool, quoted: bool = False) -> None:
        host = self._host()
        src = self._lookup(q)
        if src is None and host is None:
            raise _Veto(f"qualifier {q} is not bound")
        cols = self.columns_for(q, quoted)
        if cols is not None and not (col in cols if final else any(c.startswith(col) for c in cols)):
            raise _Veto(f"{col} is not a column of {q}")
        if src is None and final:
            host.pending.setdefault(q, set()).add(col)

    def columns_for(self, q: str, quoted: bool = False) -> frozenset[str] | None:
        """Columns that may follow `q.` now: of its source; of a table or CTE of that name when FROM
        has yet to declare it; None (any name: a derived table declared later may have it) for another
        name FROM has yet to declare (quoted: any known column). Unquoted: only those written bare."""
        src = self._lookup(q)
        if src is None:
            src = q if self._is_source(q) else None
        if src is None and self.dot_limit is not None and q == self.dot_q:  # (the budget: sql_budget.py)
            return self.dot_limit if quoted else _bare(self.dot_limit, self._keywords())
        if src is None and not quoted:
            return None
        cols = self._cols(src) if src is not None else self._all_columns()
        return cols if quoted else _bare(cols, self._keywords())

    def word_pool(self, at: str | None = None, quoted: bool = False) -> WordPool | None:
        """What an unquoted word starting here (after `at`, default the last word or punctuation) may
        be, or None where words are not checked: outside an operand or a FROM source, or while a scope
        before its FROM may still bind a new qualifier."""
        at = self.at if at is None else at
        if self.words is None or self.done or (self.mode and not quoted) or self.dot_q is not None:
            return None
        kws = self._keywords()

        def bare(names: set[str]) -> frozenset[str]:  # quoted: any spelling (the grammar has the real ones)
            return frozenset(names) if quoted else _bare(frozenset(names), kws)

        scopes = [f for f in self.stack if f.scope]
        f = scopes[-1]
        if f.phase == "from" and f.expect == "source" and self.stack[-1] is f and f.with_state in ("", "after"):
            ok = {t for t in self.tables if not any(n in self.tables[t] and self._matches(f, n) for n in f.bare)}
            ok |= {c for c in self.ctes if not any(n in self.derived[c] and self._matches(f, n) for n in f.bare)}
            return WordPool(bare(ok), frozenset())
        if (f.phase == "from" and f.expect == "after_source" and self.stack[-1] is f and f.source_own
                and f.source_name in f.pending):
            # a table used as a qualifier before FROM keeps its name: no alias but that name, only what may
            # follow one
            return WordPool(_AFTER_SOURCE | {"as"} | bare({f.source_name}), frozenset())
        if (f.phase == "from" and f.expect == "alias" and self.stack[-1] is f and f.source_own
                and f.source_name in f.pending):
            return WordPool(bare({f.source_name}), frozenset())
        if at not in self.words.before_operand:
            return None
        if not (f.phase in ("select", "after") or (f.phase == "from" and f.expect == "on")):
            return None  # (not an operand: a CTE's name, a query's first keyword, a FROM source or alias)
        # a scope before its FROM may bind new names: checked only where the token budget narrows them
        budgeted = self._host() is not None
        if budgeted and (tier := self.tier()) == ANY:
            return None
        # names that can be written unquoted (the others are not checked)
        cols = {c for g in scopes for src in g.declared.values() for c in self._cols(src)}
        ends = {c for c in bare(cols) if self._resolves(f, c)}
        if budgeted:  # and those that add no FROM item, or (the SCHEMA tier) a short one
            schema = {c for t in self.tables.values() for c in t} if tier == SCHEMA else set()
            ends |= bare(self._host().bare | schema)
        if f.clause in ("group", "having", "order"):  # a SELECT-list alias
            ends |= bare(f.aliases)
        if quoted:
            return WordPool(frozenset(ends), frozenset())
        after = self.words.after.get(at, frozenset())
        if at == "(" and not self.stack[-1].over:
            after = after - _WINDOW_WORDS
        if at == "(" and self.stack[-1].call:  # a call's argument is an operand: `f((SELECT ...))`, not `f(SELECT`
            after = after - _QUERY_WORDS
        in_sum = at in _IN_SUM or (at in ("(", ",") and self.stack[-1].func in self.words.value_args)
        ends |= (self.words.operand - _PREDICATE_WORDS if in_sum else self.words.operand) | after
        quals = {q for g in scopes for q in g.declared}
        if budgeted:
            quals |= self.new_qualifiers(tier)
        return WordPool(frozenset(ends), bare(quals - ends))

    def _qualifier(self, q: str) -> None:
        self.dot_limit = None
        if self._lookup(q) is None:
            if self._host() is None:
                raise _Veto(f"qualifier {q} is not bound")
            if (names := self.new_qualifiers(self.word_tier)) is not None:  # (the tier where the word started)
                if q not in names:
                    raise _Veto(f"qualifier {q}: its FROM item would not fit in the tokens left")
                if not self._is_source(q):  # only the columns it was used with (a new one lengthens its FROM item)
                    self.dot_limit = frozenset(self._host().pending[q])
        self._item(self._scope(), "w", q)
        self._item(self._scope(), "p", ".")
        self.dot_q = q

    def _host(self) -> _Frame | None:
        """The innermost scope whose FROM is still to come (it binds new qualifiers and bare names): one in its
        SELECT list. Not a WITH clause's statement (phase start): its query's FROM cannot bind a CTE body's names,
        and its SELECT starts a new scope."""
        return next((f for f in reversed(self.stack) if f.scope and f.phase == "select"), None)

    def tier(self) -> int:
        """What the token budget admits as a new name here (sql_budget.py): ANY where no scope before its FROM
        could bind one or there is no budget."""
        return ANY if self.budget is None or self._host() is None else self.budget.tier(self)

    def new_qualifiers(self, tier: int) -> frozenset[str] | None:
        """The undeclared names a `q.` may use at budget `tier` (sql_budget.py): None where any name may; else
        those already pending in the scope that binds them (with a column), and at the SCHEMA tier the tables."""
        if tier == ANY or (host := self._host()) is None:
            return None
        names = {q for q, cols in host.pending.items() if cols or self._is_source(q)}
        return frozenset(names | set(self.tables) if tier == SCHEMA else names)

    def ordinal_ok(self, digits: str) -> bool:
        """Whether a number written here may begin with `digits`: a number that starts an ORDER BY or
        GROUP BY item is read as an output column's position (1 to the SELECT list's length)."""
        f = self._scope()
        at = self.word_at if self.word else self.at
        if not (self.in_by_list() and at in ("by", ",")):
            return True
        return any(str(k).startswith(digits) for k in range(1, f.items + 1))

    def in_by_list(self) -> bool:
        """In the ORDER BY or GROUP BY list of the current scope (not in a parenthesis)."""
        f = self._scope()
        return f.clause in ("order", "group") and self.stack[-1] is f and not self.mode

    def only_banned(self, word: str) -> bool:
        """`word` can only grow into a banned clause keyword (not into another keyword that may follow
        here: OVER, OR, ...)."""
        follow = self._follow()
        return any(k.startswith(word) for k in self.banned) and not any(
            k.startswith(word) for k in (self._keywords() if follow is None else follow) if k not in _BANNED)

    def _follow(self) -> frozenset[str] | None:
        """The keywords a word starting here may be, where the position narrows them (None: any):
        after a SELECT item's alias or a `*` item only FROM (or a clause keyword); after a FROM source's alias only
        a join word, ON or USING; after a USING list only a join word."""
        f = self._scope()
        if self.stack[-1] is not f:
            return None
        parts = f.item
        if f.phase == "select" and len(parts) >= 2 and parts[-1][0] == "w" and (
                parts[-2] == ("k", "as") or parts[-2][0] in "wv" or parts[-2] == ("p", ")")):
            return _AFTER_ALIAS
        if f.phase == "select" and self.at == "*" and parts[-1:] == [("p", "*")] and (
                len(parts) == 1 or parts[-2] in (("p", "."), ("p", ","))):  # after a `*` item: as after an alias
            return _AFTER_ALIAS
        if f.phase == "from" and f.expect == "aliased":
            return _AFTER_SOURCE_ALIAS | {"on", "using"} if f.joined else _AFTER_SOURCE_ALIAS
        if f.phase == "from" and f.expect == "using" and self.at == ")":  # the USING list closed
            return _AFTER_USING
        return None

    def _bans(self) -> tuple[str, ...]:
        """Clause keywords a word starting here may not become: after a complete operand (or source)
        in a scope whose names used before FROM are not all bound yet."""
        f = self._scope()
        if self.stack[-1] is not f or f.phase not in ("select", "from") or not (f.pending or f.bare):
            return ()
        star = self.at == "*" and f.item[-1:] == [("p", "*")] and (len(f.item) == 1 or f.item[-2] in (("p", "."), ("p", ",")))
        if not star and (self.at in self._before_operand() or self.at in ("as", "join", "from", "with", "on", "using")
                         or self.at in _JOIN_WORDS):
            return ()
        if not self._unbound(f):
            return ()
        return _BANNED

    # -- characters ------------------------------------------------------------------------
    def feed(self, text: str) -> None:
        """One token's text (a word it leaves half-written may not be on its way to a banned keyword)."""
        for ch in text:
            self._char(ch)
        if self.word and self.banned and not self.mode and self.only_banned(self.word):
            raise _Veto(f"{self.word} would start a clause while names are unbound")

    def _char(self, ch: str) -> None:
        prev, self.prev = self.prev, ch
        if self.done:
            return
        if self.mode and self.mode in ("'", self.string):
            if ch == self.mode:
                self.mode, self.at, self.string = "", "", ""
            return
        if self.mode:
            if ch == self.mode:
                self.mode = ""
                if (self.words is not None and ch in self.words.strings and not self._is_column(self.word)
                        and not self._at_source()):
                    self.word, self.pool, self.at = "", None, ""  # a string literal (SQLite's rule)
                    self._item(self._scope(), "v", "'")
                    return
                self._complete(quoted=True, follow="")
            else:
                self.word += ch.lower()
                if self.dot_q is not None:
                    self._column(self.dot_q, self.word, final=False, quoted=True)
                elif self.pool is not None and not self.pool.admits(self.word):
                    raise _Veto(f"{self.word} is not a name that can be written here")
            return
        if ch in _ID or (ch == "." and self.word[:1].isdigit()):
            if not self.word:
                self._argument(ch)
                self.pool = None if ch.isdigit() else self.word_pool()
                self.banned = () if ch.isdigit() or self.dot_q is not None else self._bans()
                self.word_at = self.at
                self.word_tier = self.tier()
            self.word += ch.lower()
            if self.word[:1].isdigit() and not self.ordinal_ok(self.word):
                raise _Veto(f"ORDER BY / GROUP BY {self.word}: no such output column")
            if self.dot_q is not None and ch != ".":
                self._column(self.dot_q, self.word, final=False)
            elif self.pool is not None and not self.pool.admits(self.word):
                raise _Veto(f"{self.word} can only go on as an unbound name")
            return
        if self.word:
            self._complete(quoted=False, follow=ch)
        if ch.isspace():  # (the grammar puts no whitespace before a qualifier's ".": `.5` is a number)
            self.last = None
            return
        self._argument(ch)
        if self.fenced and ch == "`" and prev == "\n":
            self.end()
            self.done = True
            return
        last, self.last = self.last, None
        before, self.at = self.at, ch
        f = self._scope()
        if self.stack[-1].fresh and ch != "(":
            self.stack[-1].fresh = False
        if self.dot_q is not None and ch == "*":  # q.*: q must be bound like a qualified column
            q, self.dot_q = self.dot_q, None
            if self._lookup(q) is None:
                host = self._host()
                host.pending.setdefault(q, set())
            self._item(f, "p", ch)
        elif ch == ".":
            if last is not None:
                self._qualifier(last)
        elif ch == "'" or (self.words is not None and ch in self.words.strings and ch not in self.words.quotes):
            self.mode = self.string = ch
            self._item(f, "v", "'")
        elif ch in _QUOTE_CLOSE:
            self.mode, self.quoted = _QUOTE_CLOSE[ch], True
            self.word_at = before
            self.word_tier = self.tier()
            # a name: a prefix of one that can be written here (a quote that may also open a string: any)
            either = self.words is not None and ch in self.words.strings
            self.pool = self.word_pool(before, quoted=True) if self.dot_q is None and not either else None
            if self.pool is not None and not self.pool.words:
                raise _Veto("no quoted name can be written here")
        elif ch == "(":
            source = f.phase == "from" and f.expect == "source" and self.stack[-1] is f
            self._item(f, "p", "(")
            frame = _Frame(scope=False, source=source, over=before == "over",
                           func=before if self.words is not None and before in self.words.arity else "",
                           call=self.words is not None and before in self.words.functions)
            if f.with_state == "body" and self.stack[-1] is f:
                frame.cte, f.with_state = f.source_name, "after"
            self.stack.append(frame)
        elif ch == ")" and len(self.stack) > 1:
            closed = self.stack[-1]
            if closed.scope:  # (on top: its last SELECT item ends here)
                self._end_scope(closed)
            self.stack.pop()
            f = self._scope()
            self._item(f, "p", ")")
            if closed.cte is not None:
                self.derived[closed.cte] = closed.outputs or frozenset()
                self.ctes.add(closed.cte)
                f.source_name = None
            if closed.source:
                key = f"#{len(self.derived)}"
                self.derived[key] = closed.outputs or frozenset()
                self._add_source(f, key, key)  # its columns are in scope even without an alias
                f.expect = "after_source"
        elif ch == "," and self.stack[-1] is f:
            if f.with_state == "after":
                f.with_state = "name"
            elif f.phase == "from":
                f.expect, f.joined = "source", False
            elif f.phase == "select":
                self._finish_item(f)
        elif ch == ";":
            self.end()
        else:
            self._item(f, "p", ch)

    def _argument(self, ch: str) -> None:
        """Argument counts of a function call (its frame is on top): a first argument begins, a comma
        starts one more, `)` ends the call."""
        top = self.stack[-1]
        if not top.func:
            return
        least, most = self.words.arity[top.func]
        if ch == ")":
            if top.args < least:
                raise _Veto(f"{top.func} takes at least {least} arguments")
        elif ch == "," and top.args:
            if most is not None and top.args >= most:
                raise _Veto(f"{top.func} takes at most {most} arguments")
            top.args += 1
        elif not top.args:
            top.args = 1  # (the grammar admits no function with no argument here but FUNC_NONE's)

    def _complete(self, quoted: bool, follow: str) -> None:
        w, self.word = self.word, ""
        pool, self.pool = self.pool, None
        self.banned = ()
        if w[:1].isdigit():
            self.last, self.at = None, ""
            self._item(self._scope(), "v", "0")
            return
        if pool is not None and follow != "." and w not in pool.ends:
            raise _Veto(f"{w} is not a column, alias or function here")
        saved, self.at = self.at, self.word_at
        try:
            self._word(w, quoted, follow)
        except _Veto:
            self.at = saved
            raise
