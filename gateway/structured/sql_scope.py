"""Alias binding for SQL decoding: a scope tracker over the generated text that vetoes tokens which
would leave a qualifier unbound (PICARD-style incremental checks on top of the Lark grammar).

A CFG cannot tie `T1.name` in a SELECT list to the `FROM singer AS T1` that comes after it, so the
grammar admits any alias and this guard binds them while decoding:

- a qualifier (`q.`) must name an alias/table declared by the current or an enclosing scope, or
  else is recorded as *pending* in the innermost scope whose FROM has not started yet (none: veto);
- the column after `q.` must be a column of q's table (pending: of some table that has all the
  columns used with q so far), checked on every character, so it never dead-ends;
- a FROM clause can only end (WHERE/GROUP/ORDER/LIMIT/HAVING/set operator/`)`/`;`/EOS) once every
  pending qualifier of its scope is declared, and an alias that is pending can only be declared for a
  table that has its columns; a scope cannot end or skip FROM with qualifiers pending.

- where every qualifier must already be bound (no scope before its FROM) and a word starts an operand
  of WHERE/ON/GROUP BY/HAVING/ORDER BY, an unquoted word must stay a prefix of a word that can be
  written there: a column of the tables in scope, a bound alias/table/CTE (as a qualifier), in ORDER
  BY a word of the scope's SELECT lists (an alias), a function, or a keyword that can start an
  operand there (so a name that could only go on as an unbound qualifier is never started).

Tables named by a subquery or a CTE have columns the guard does not track: their columns are left to
sqlglot (validate.py), which still rejects unknown columns, and with one in scope words are not checked.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

SCHEMA_COMMENT = "// moegate-sql-tables: "  # sql_grammar.py writes the tables it allows after this
WORDS_COMMENT = "// moegate-sql-words: "  # and its keywords, functions and operand positions after this
_ID = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")
_CLAUSE_END = frozenset(("where", "group", "having", "order", "limit", "union", "intersect", "except"))
_JOIN_WORDS = frozenset(("inner", "left", "right", "full", "outer", "cross", "natural"))
_QUOTE_CLOSE = {'"': '"', "`": "`", "[": "]"}
_BARE = re.compile(r"[a-z_][a-z0-9_]*\Z")  # a name the grammar takes unquoted (unless a keyword)
DERIVED = ""  # the table of an alias bound to a subquery or a CTE (columns not tracked)


@functools.lru_cache(maxsize=4096)
def _bare(names: frozenset[str], keywords: frozenset[str]) -> frozenset[str]:
    """The names that the grammar takes unquoted."""
    return frozenset(n for n in names if _BARE.match(n) and n not in keywords)


@dataclass
class _Frame:
    scope: bool  # a SELECT scope, or a plain parenthesis
    fresh: bool = True  # nothing inside yet (a paren becomes a scope when SELECT/WITH follows)
    source: bool = False  # opened where FROM expects a source (a derived table)
    phase: str = "start"  # start | select | from | after
    expect: str = "source"  # in FROM: source | after_source | alias | on
    declared: dict[str, str] = field(default_factory=dict)  # alias -> table (DERIVED: untracked)
    pending: dict[str, set[str]] = field(default_factory=dict)  # qualifier -> columns used before FROM
    source_name: str | None = None  # the last FROM source (table name, DERIVED) awaiting an alias
    outputs: set[str] = field(default_factory=set)  # words of its SELECT lists (aliases, columns)
    clause: str = ""  # the last clause keyword of the scope (where, group, having, order, limit, union...)

    def clone(self) -> _Frame:
        return _Frame(self.scope, self.fresh, self.source, self.phase, self.expect, dict(self.declared),
                      {q: set(c) for q, c in self.pending.items()}, self.source_name, set(self.outputs),
                      self.clause)


@dataclass(frozen=True)
class SQLWords:
    """The grammar's words for the word check (from its WORDS_COMMENT line)."""

    keywords: frozenset[str]
    functions: frozenset[str]
    before_operand: frozenset[str]  # a word or punctuation after which an operand starts
    operand: frozenset[str]  # keywords and functions that may start an operand
    after: dict[str, frozenset[str]]  # keywords that may also start one right after a word/punctuation

    @classmethod
    def from_json(cls, d: dict) -> SQLWords:
        functions = frozenset(d["functions"])
        return cls(frozenset(d["keywords"]), functions, frozenset(d["before_operand"]),
                   frozenset(d["operand"]) | functions, {k: frozenset(v) for k, v in d["after"].items()})


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
        self.word, self.quoted = "", False
        self.last: str | None = None  # the word that the current character ended
        self.dot_q: str | None = None  # qualifier of the column being written
        self.prev = ""
        self.at = ""  # the last word (lower case, unquoted) or punctuation; "" after a value
        self.pool: WordPool | None = None  # what the word being written may become (None: unchecked)
        self.ctes: set[str] = set()
        self.done = False  # the statement ended (the closing fence of a segment)

    def clone(self) -> SQLScope:
        new = object.__new__(SQLScope)
        new.__dict__.update(self.__dict__)
        new.stack = [f.clone() for f in self.stack]
        new.ctes = set(self.ctes)
        return new

    # -- scopes ----------------------------------------------------------------------------
    def _scope(self) -> _Frame:
        return next(f for f in reversed(self.stack) if f.scope)

    def _lookup(self, q: str) -> str | None:
        for f in reversed(self.stack):
            if f.scope and q in f.declared:
                return f.declared[q]
        return None

    def _columns_ok(self, q: str, cols: set[str]) -> bool:
        if q in self.ctes:
            return True
        if q in self.tables:  # a table's own name qualifies only its columns
            return cols <= self.tables[q]
        return any(cols <= c for c in self.tables.values())

    def _end_from(self, f: _Frame) -> None:
        for q, cols in f.pending.items():
            table = f.declared.get(q)
            if table is None or (table != DERIVED and not cols <= self.tables.get(table, frozenset())):
                raise _Veto(f"qualifier {q} is not bound by FROM")
        f.pending.clear()
        f.phase = "after"

    def _end_scope(self, f: _Frame) -> None:
        if f.phase == "from":
            self._end_from(f)
        elif f.pending:
            raise _Veto("qualifiers used without a FROM clause")

    def end(self) -> None:
        """The statement ends here (EOS, `;`, the closing fence)."""
        if self.word and not self.mode:
            self._complete(quoted=False, follow="")
        for f in self.stack:
            if f.scope:
                self._end_scope(f)

    def _declare(self, f: _Frame, alias: str) -> None:
        table = f.source_name if f.source_name is not None else DERIVED
        if f.source_name is not None and f.declared.get(f.source_name) == f.source_name:
            if f.source_name in f.pending:
                raise _Veto(f"table {f.source_name} is used as a qualifier: it cannot take an alias")
            del f.declared[f.source_name]
        if alias in f.pending and table != DERIVED and not f.pending[alias] <= self.tables.get(table, frozenset()):
            raise _Veto(f"alias {alias} is used with columns that {table} does not have")
        f.declared[alias] = table

    # -- words -----------------------------------------------------------------------------
    def _word(self, w: str, quoted: bool, follow: str) -> None:
        kw = "" if quoted else w
        self.at = kw
        if w.startswith("cte_"):
            self.ctes.add(w)
        if self.dot_q is not None:  # the column of a qualified reference (checked as it was typed)
            q, self.dot_q = self.dot_q, None
            self._column(q, w, final=True)
            self.last, self.at = None, ""
            return
        top = self.stack[-1]
        if not top.scope and top.fresh and kw in ("select", "with"):
            top.scope = True
        top.fresh = False
        f = self._scope()
        if f.phase == "select" and follow not in ".(" and kw not in self._keywords():
            f.outputs.add(w)
        if kw in _CLAUSE_END and self.stack[-1] is f:
            f.clause = kw
        if kw == "select":
            if f.phase != "start":
                self._end_scope(f)
            f.phase, f.declared, f.pending, f.expect = "select", {}, {}, "source"
        elif kw == "from" and f.phase == "select":
            f.phase, f.expect = "from", "source"
        elif kw in _CLAUSE_END and f.phase in ("select", "from") and self.stack[-1] is f:
            self._end_scope(f)
        elif f.phase == "from" and self.stack[-1] is f:
            self._from_word(f, w, kw)
        self.last = w

    def _keywords(self) -> frozenset[str]:
        return self.words.keywords if self.words is not None else frozenset()

    def _from_word(self, f: _Frame, w: str, kw: str) -> None:
        if f.expect == "source":
            f.source_name = w if w in self.tables else DERIVED
            f.declared[w] = f.source_name if w in self.tables else DERIVED
            f.expect = "after_source"
        elif kw == "join":
            f.expect = "source"
        elif f.expect == "on" or kw in _JOIN_WORDS:
            return
        elif kw in ("on", "using"):
            f.expect = "on"
        elif kw == "as" and f.expect == "after_source":
            f.expect = "alias"
        elif f.expect in ("alias", "after_source"):
            self._declare(f, w)
            f.expect, f.source_name = "on", None  # nothing but a join or an end may follow

    def _column(self, q: str, col: str, final: bool) -> None:
        table = self._lookup(q)
        if table == DERIVED or (table is None and q in self.ctes):
            return
        if table is not None:
            ok = col in self.tables[table] if final else any(c.startswith(col) for c in self.tables[table])
        else:
            host = next((f for f in reversed(self.stack) if f.scope and f.phase in ("start", "select")), None)
            if host is None:
                raise _Veto(f"qualifier {q} is not bound")
            used = host.pending.get(q, set())
            pool = [c for t, c in self.tables.items() if (t == q or q not in self.tables) and used <= c]
            ok = any(col in c for c in pool) if final else any(x.startswith(col) for c in pool for x in c)
            if ok and final:
                host.pending.setdefault(q, set()).add(col)
        if not ok:
            raise _Veto(f"{col} is not a column of {q}")

    def columns_for(self, q: str) -> set[str]:
        """Columns that may follow `q.` now (empty: any, the table is a subquery or a CTE)."""
        table = self._lookup(q)
        if table == DERIVED or (table is None and q in self.ctes):
            return set()
        if table is not None:
            return set(self.tables[table])
        host = next((f for f in reversed(self.stack) if f.scope and f.phase in ("start", "select")), None)
        used = host.pending.get(q, set()) if host is not None else set()
        return {c for t, cols in self.tables.items() if (t == q or q not in self.tables) and used <= cols
                for c in cols}

    def word_pool(self, at: str | None = None) -> WordPool | None:
        """What an unquoted word starting here (after `at`, default the last word or punctuation) may
        be, or None where words are not checked: outside an operand, while a scope before its FROM
        may still bind a new qualifier, or with a derived table (its columns are unknown) in scope."""
        at = self.at if at is None else at
        if self.words is None or self.done or self.mode or self.dot_q is not None:
            return None
        if at not in self.words.before_operand:
            return None
        scopes = [f for f in self.stack if f.scope]
        f = scopes[-1]
        if not (f.phase == "after" or (f.phase == "from" and f.expect == "on")):
            return None
        if any(g.phase in ("start", "select") for g in scopes):
            return None
        tables = {t for g in scopes for t in g.declared.values()}
        if DERIVED in tables:
            return None
        # names that can be written unquoted (the others are not checked)
        ends = {c for t in tables for c in _bare(self.tables[t], self._keywords())}
        if f.clause == "order":  # the grammar takes a SELECT-list alias (OUTPUT_NAME) there only
            ends |= _bare(frozenset(f.outputs), self._keywords())
        ends |= self.words.operand | self.words.after.get(at, frozenset())
        quals = {q for g in scopes for q in g.declared} | self.ctes
        return WordPool(frozenset(ends), _bare(frozenset(quals - ends), self._keywords()))

    def _qualifier(self, q: str) -> None:
        if self._lookup(q) is None and q not in self.ctes:
            if not any(f.scope and f.phase in ("start", "select") for f in self.stack):
                raise _Veto(f"qualifier {q} is not bound")
            if not self._columns_ok(q, set()):
                raise _Veto(f"qualifier {q} names no table")
        self.dot_q = q

    # -- characters ------------------------------------------------------------------------
    def feed(self, text: str) -> None:
        for ch in text:
            self._char(ch)

    def _char(self, ch: str) -> None:
        prev, self.prev = self.prev, ch
        if self.done:
            return
        if self.mode == "'":
            if ch == "'":
                self.mode, self.at = "", ""
            return
        if self.mode:
            if ch == self.mode:
                self.mode = ""
                self._complete(quoted=True, follow="")
            else:
                self.word += ch.lower()
                if self.dot_q is not None:
                    self._column(self.dot_q, self.word, final=False)
            return
        if ch in _ID or (ch == "." and self.word[:1].isdigit()):
            if not self.word:
                self.pool = None if ch.isdigit() else self.word_pool()
            self.word += ch.lower()
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
        if self.fenced and ch == "`" and prev == "\n":
            self.end()
            self.done = True
            return
        last, self.last = self.last, None
        self.at = ch
        if self.stack[-1].fresh and ch != "(":
            self.stack[-1].fresh = False
        if ch == ".":
            if last is not None:
                self._qualifier(last)
        elif ch == "'":
            self.mode = "'"
        elif ch in _QUOTE_CLOSE:
            self.mode, self.quoted = _QUOTE_CLOSE[ch], True
        elif ch == "(":
            f = self._scope()
            source = f.phase == "from" and f.expect == "source" and self.stack[-1] is f
            self.stack.append(_Frame(scope=False, source=source))
        elif ch == ")" and len(self.stack) > 1:
            closed = self.stack.pop()
            if closed.scope:
                self._end_scope(closed)
            if closed.source:
                f = self._scope()
                f.source_name, f.expect = None, "after_source"
                f.declared[""] = DERIVED  # its columns are in scope even without an alias
        elif ch == "," and self.stack[-1] is self._scope() and self._scope().phase == "from":
            self._scope().expect = "source"
        elif ch == ";":
            self.end()

    def _complete(self, quoted: bool, follow: str) -> None:
        w, self.word = self.word, ""
        pool, self.pool = self.pool, None
        if w[:1].isdigit():
            self.last, self.at = None, ""
            return
        if pool is not None and follow != "." and w not in pool.ends:
            raise _Veto(f"{w} is not a column, alias or function here")
        self._word(w, quoted, follow)
