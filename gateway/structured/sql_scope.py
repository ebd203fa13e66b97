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
import json
import re
from dataclasses import dataclass, field

import numpy as np

from .vocab import TokenizerInfo

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


_QUAL_HEAD = re.compile(r"^[ \t\r\n]*([A-Za-z0-9_]*)\.$")
_HOT_CHARS = frozenset(".);'\"`[]")
_SAFE_HEAD = frozenset(" \t\r\n=<>!+-*/%|(")  # a head of these changes no scope: only where a word starts
# Words whose completion can end a FROM clause or a scope (the others cannot veto, except aliases).
_RELEVANT = _CLAUSE_END | {"select"}


@dataclass(frozen=True, eq=False)
class _TokenTable:
    """Per-tokenizer arrays that let `filter` simulate only the tokens that can veto."""

    texts: list[str]  # per id: its bytes as latin-1 text
    lower: list[str]  # the same, lower case
    delim: np.ndarray  # [V] bool: holds a non-identifier byte
    dots: np.ndarray  # [V] bool: holds a "."
    hot: np.ndarray  # [V] bool: its head holds . ) ; a quote, or completes a word of _RELEVANT inside it
    head: np.ndarray  # [V] int: index into heads of its text up to and including its last non-identifier byte
    heads: list[str]
    leads: dict[str, np.ndarray]  # lower-case identifier bytes before the first non-identifier byte -> ids
    inners: dict[str, np.ndarray]  # a word that starts and ends inside the token's head -> ids
    qual: np.ndarray  # [V] int: >= 0 where the head is `<whitespace><identifier>.` (a qualifier)
    quals: dict[str, np.ndarray]  # that identifier, lower case -> ids
    idents: dict[str, np.ndarray]  # lower-case text of identifier-only tokens -> ids
    tails: dict[str, np.ndarray]  # lower-case identifier after the last non-identifier byte -> ids
    tailed: np.ndarray  # [V] bool: holds a non-identifier byte and identifier bytes after the last one
    tail_at: np.ndarray  # [V] uint8: its head's last non-whitespace byte (0: none, 1: an identifier byte)
    safe: np.ndarray  # [V] bool: its head holds only whitespace and "=<>!+-*/%|(" (_SAFE_HEAD)
    safe_comma: np.ndarray  # [V] bool: those and ","
    lead_empty: np.ndarray  # [V] bool: starts with a non-identifier byte
    first_dot: np.ndarray  # [V] bool: its first non-identifier byte is "."
    digit_start: np.ndarray  # [V] bool: starts with a digit (a number, where a word would start)
    digit_tail: np.ndarray  # [V] bool: the identifier after its last non-identifier byte starts with a digit


@functools.lru_cache(maxsize=8)
def _token_table(tokenizer: TokenizerInfo) -> _TokenTable:
    texts, index, leads, inners, quals, idents, tails = [], {}, {}, {}, {}, {}, {}
    n = tokenizer.vocab_size
    delim, dots, hot, tailed, lead_empty, first_dot, digit_start, digit_tail = (
        np.zeros(n, dtype=bool) for _ in range(8))
    tail_at = np.zeros(n, dtype=np.uint8)
    safe, safe_comma = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
    qual = np.full(n, -1, dtype=np.int64)
    head = np.zeros(n, dtype=np.int64)
    for i, b in enumerate(tokenizer.token_bytes[:n]):
        t = (b or b"").decode("latin-1")
        texts.append(t)
        digit_start[i] = t[:1].isdigit()
        cuts = [k for k, ch in enumerate(t) if ch not in _ID]
        if not cuts:
            if t:
                idents.setdefault(t.lower(), []).append(i)
            continue
        h = t[: cuts[-1] + 1]
        delim[i], dots[i] = True, "." in t
        lead_empty[i], first_dot[i] = cuts[0] == 0, t[cuts[0]] == "."
        if tail := t[len(h):].lower():
            tailed[i], digit_tail[i] = True, tail[0].isdigit()
            body = h.rstrip(" \t\r\n")
            tail_at[i] = 0 if not body else 1 if body[-1] in _ID else ord(body[-1])
            safe[i], safe_comma[i] = set(h) <= _SAFE_HEAD, set(h) <= _SAFE_HEAD | {","}
            tails.setdefault(tail, []).append(i)
        words = [t[a + 1:c].lower() for a, c in zip(cuts, cuts[1:], strict=False) if c > a + 1]
        for w in words:
            inners.setdefault(w, []).append(i)
        hot[i] = bool(_HOT_CHARS & set(h)) or any(w in _RELEVANT for w in words)
        head[i] = index.setdefault(h, len(index))
        leads.setdefault(t[: cuts[0]].lower(), []).append(i)
        if (m := _QUAL_HEAD.match(h)) and "." not in t[len(h):]:
            qual[i] = 1
            quals.setdefault(m.group(1).lower(), []).append(i)
    def arrays(d: dict[str, list[int]]) -> dict[str, np.ndarray]:
        return {k: np.array(v, dtype=np.int64) for k, v in d.items()}

    return _TokenTable(texts, [t.lower() for t in texts], delim, dots, hot, head, list(index), arrays(leads),
                       arrays(inners), qual, arrays(quals), arrays(idents), arrays(tails), tailed, tail_at,
                       safe, safe_comma, lead_empty, first_dot, digit_start, digit_tail)


@functools.lru_cache(maxsize=64)
def _tail_checks(tt: _TokenTable, before_operand: frozenset[str]) -> np.ndarray:
    """[V] bool: tokens whose identifier after the last non-identifier byte may start a checked word
    (the head ends in punctuation that may precede an operand, or in a word or whitespace)."""
    codes = [0, 1] + [ord(c) for c in before_operand if len(c) == 1]
    return tt.tailed & np.isin(tt.tail_at, np.array(codes, dtype=np.uint8))


@functools.lru_cache(maxsize=64)
def _tail_classes(tt: _TokenTable, before_operand: frozenset[str], after: frozenset[str]) -> dict[str, np.ndarray]:
    """Tokens with an identifier after their head, by the punctuation before it ("" for whitespace),
    one class per pool: the bytes with words of their own (in `after`), and one for the rest."""
    own = sorted(c for c in after if len(c) == 1 and c in before_operand)
    rest = sorted(c for c in before_operand if len(c) == 1 and c not in own)
    classes = {"": tt.tailed & (tt.tail_at == 0)}
    classes |= {c: tt.tailed & (tt.tail_at == ord(c)) for c in own}
    if rest:
        classes[rest[0]] = tt.tailed & np.isin(tt.tail_at, np.array([ord(c) for c in rest], dtype=np.uint8))
    return classes


_NONE = np.zeros(0, dtype=np.int64)


def _word_ids(tt: _TokenTable, pool: WordPool, word: str) -> np.ndarray:
    """Tokens that keep `word` a prefix of a word of `pool`: identifier-only ones that extend it, and
    ones whose leading identifier completes it (before a "." only as a qualifier)."""
    n, ids = len(word), []
    pieces = {a[n:k] for a in pool.words if a.startswith(word) for k in range(n + 1, len(a) + 1)}
    ids += [x for p in pieces if (x := tt.idents.get(p)) is not None]
    for a in pool.words:
        if len(a) > n and a.startswith(word) and (x := tt.leads.get(a[n:])) is not None:
            ids.append(x if a in pool.ends else x[tt.first_dot[x]])
    return np.concatenate(ids) if ids else _NONE


@functools.lru_cache(maxsize=64)
def _word_mask(tt: _TokenTable, pool: WordPool, word: str) -> np.ndarray:
    """[V] bool: the tokens that keep `word` (being written where `pool` applies) within it."""
    ok = np.zeros(len(tt.texts), dtype=bool)
    ok[_word_ids(tt, pool, word)] = True
    if not word:  # a token that starts with a delimiter or a digit starts no word
        ok |= tt.lead_empty | tt.digit_start
    elif word in pool.ends:  # ended by the token's first byte
        ok |= tt.lead_empty
    else:  # only as a qualifier
        ok |= tt.lead_empty & tt.first_dot
    return ok


@functools.lru_cache(maxsize=64)
def _tail_mask(tt: _TokenTable, pool: WordPool) -> np.ndarray:
    """[V] bool: tokens whose identifier after their last non-identifier byte starts a word of
    `pool` (or a number)."""
    ok = tt.digit_tail.copy()
    pieces = {a[:k] for a in pool.words for k in range(1, len(a) + 1)}
    if ids := [x for p in pieces if (x := tt.tails.get(p)) is not None]:
        ok[np.concatenate(ids)] = True
    return ok


class SQLScopeGuard:
    """Per-sequence guard: `consume` each generated token, `filter` each mask row, `allows_end`."""

    def __init__(self, tables: dict[str, frozenset[str]], tokenizer: TokenizerInfo, fenced: bool,
                 words: SQLWords | None = None) -> None:
        self.scope = SQLScope(tables, fenced, words)
        self.table = _token_table(tokenizer)

    @classmethod
    def from_grammar(cls, grammar: str, tokenizer: TokenizerInfo) -> SQLScopeGuard | None:
        """The guard of an SQL grammar from sql_grammar.py (None for grammars without its tables line)."""
        at = grammar.find(SCHEMA_COMMENT)
        if at < 0:
            return None
        line = grammar[at + len(SCHEMA_COMMENT):].split("\n", 1)[0]
        tables = {t.lower(): frozenset(c.lower() for c in cols) for t, cols in json.loads(line).items()}
        at = grammar.find(WORDS_COMMENT)
        words = (SQLWords.from_json(json.loads(grammar[at + len(WORDS_COMMENT):].split("\n", 1)[0]))
                 if at >= 0 else None)
        return cls(tables, tokenizer, fenced='"\\n```"' in grammar, words=words)

    def _text(self, token: int) -> str:
        return self.table.texts[token] if token < len(self.table.texts) else ""

    def consume(self, token: int) -> None:
        try:
            self.scope.feed(self._text(token))
        except _Veto:  # only reachable if a vetoed token was forced in; validation reports it
            pass

    def allows(self, tokens: list[int], final: bool) -> bool:
        """Whether `tokens` (after the text so far) keep every qualifier bindable (and, `final`, bound)."""
        state = self.scope.clone()
        try:
            for t in tokens:
                state.feed(self._text(t))
            if final:
                state.end()
            return True
        except _Veto:
            return False

    def allows_end(self) -> bool:
        return self.allows([], final=True)

    def filter(self, out: np.ndarray) -> None:
        """Clear, in mask row `out` (uint32 words), the tokens that would leave a qualifier unbound
        (or start a word that could only go on as one).

        Only tokens that can veto are simulated. While a column name is written: identifier-only
        tokens by a prefix test, the others one by one. Otherwise, with nothing pending: tokens with
        a "."; with qualifiers pending: tokens whose text holds . ) ; or a quote, or completes a word
        that ends a clause or names a pending qualifier (or the word being written, in a FROM
        clause); grouped by their text up to the last non-identifier byte. Where words are checked
        (SQLScope.word_pool), a prefix test rules on the word being written (identifier-only tokens
        and the leading identifier of the others), and after a simulated head the identifier that
        follows it is tested the same way."""
        s, tt = self.scope, self.table
        bits = np.unpackbits(out.view(np.uint8), bitorder="little")[: len(tt.texts)].astype(bool)
        drop = np.zeros(len(out) * 32, dtype=bool)  # the vetoed tokens
        keep = bits & tt.delim
        if s.dot_q is not None:  # identifier-only tokens extend the column name: a prefix test
            columns = s.columns_for(s.dot_q)
            if columns:
                prefixes = {c[:k] for c in columns for k in range(len(c) + 1)}
                drop[[t for t in np.flatnonzero(bits & ~tt.delim).tolist() if s.word + tt.lower[t] not in prefixes]] = True
                ends = np.zeros(len(tt.texts), dtype=bool)  # tokens whose leading identifier ends a column
                for c in columns:
                    if c.startswith(s.word) and (ids := tt.leads.get(c[len(s.word):])) is not None:
                        ends[ids] = True
                drop[: len(keep)] |= keep & ~ends
                keep &= ends
        else:
            if (pool := s.pool if s.word else s.word_pool()) is not None:
                ok = _word_mask(tt, pool, s.word)
                drop[: len(bits)] |= bits & ~ok
                keep &= ok
            pending = {q for f in s.stack if f.scope for q in f.pending}
            if not pending:
                sim = tt.dots.copy()
            else:
                sim = tt.hot.copy()
                for w in pending:
                    if (ids := tt.inners.get(w)) is not None:
                        sim[ids] = True
                in_from = any(f.scope and f.phase == "from" for f in s.stack)
                for w in _RELEVANT | pending | ({s.word} if in_from else set()):
                    if w.startswith(s.word) and (ids := tt.leads.get(w[len(s.word):])) is not None:
                        sim[ids] = True
            if s.words is not None and not s.mode:  # the identifier after the head may start a checked word
                drop[self._safe_tails(np.flatnonzero(keep & _tail_checks(tt, s.words.before_operand)), sim)] = True
            keep &= sim
        cands = np.flatnonzero(keep)
        drop[self._qualifier_heads(cands, tt.qual[cands] >= 0)] = True
        cands = cands[tt.qual[cands] < 0]
        heads = tt.head[cands]
        order = np.argsort(heads, kind="stable")
        cands, heads = cands[order], heads[order]
        starts = np.flatnonzero(np.r_[True, heads[1:] != heads[:-1]])
        groups = zip(heads[starts].tolist(), np.split(cands, starts[1:]), strict=True) if cands.size else ()
        for h, members in groups:
            state = s.clone()
            try:
                state.feed(tt.heads[h])
            except _Veto:
                drop[members] = True
                continue
            if state.dot_q is not None:  # the identifier tail starts a column name: check each
                drop[[t for t in members.tolist() if not self.allows([t], final=False)]] = True
            elif (tailed := members[tt.tailed[members]]).size and not state.word \
                    and (pool := state.word_pool()) is not None:
                drop[tailed[~_tail_mask(tt, pool)[tailed]]] = True
        out &= ~np.packbits(drop, bitorder="little").view(np.uint32)

    def _safe_tails(self, checks: np.ndarray, sim: np.ndarray) -> np.ndarray:
        """Vetoes among tokens (ids `checks`) with an identifier after their head, without simulating
        the heads that change nothing but where a word starts (_SAFE_HEAD), by the byte before that
        identifier (classes with one pool each); sets the other tokens in `sim`."""
        s, tt = self.scope, self.table
        veto = [_NONE]
        if not checks.size:
            return _NONE
        base = s
        if s.word:  # the token's first byte ends the word being written (as whitespace would)
            base = s.clone()
            try:
                base.feed(" ")
            except _Veto:  # those tokens are vetoed by the word check already
                base = None
        if base is not None:
            f = base._scope()
            comma = not (f.phase == "from" and base.stack[-1] is f)  # "," there starts a new source
            is_fast = (tt.safe_comma if comma else tt.safe)[checks]
            fast, checks = checks[is_fast], checks[~is_fast]
            classes = _tail_classes(tt, s.words.before_operand, frozenset(s.words.after))
            if base.word_pool(next(iter(classes.keys() - {""}), "")) is not None:  # else no class has one
                for at, members in classes.items():
                    if (pool := base.word_pool(at or base.at)) is not None:
                        m = fast[members[fast]]
                        veto.append(m[~_tail_mask(tt, pool)[m]])
        sim[checks] = True
        return np.concatenate(veto)

    def _qualifier_heads(self, cands: np.ndarray, is_qual: np.ndarray) -> list[int]:
        """Vetoes among tokens whose head is `<whitespace><identifier>.` (thousands where any name
        may start a qualifier): unbound names, unless a scope before its FROM can still bind them."""
        tt, s = self.table, self.scope
        cands = cands[is_qual]
        if not cands.size:
            return []
        veto: list[int] = []
        spaced = np.array([tt.heads[h][:1].isspace() for h in tt.head[cands].tolist()], dtype=bool)
        for group, after_space in ((cands[spaced], True), (cands[~spaced], False)):
            if not group.size:
                continue
            state = s.clone()
            if after_space:
                try:
                    state.feed(" ")
                except _Veto:
                    veto += group.tolist()
                    continue
            if state.mode:
                continue  # inside a string or a quoted name
            if any(f.scope and f.phase in ("start", "select") for f in state.stack):
                continue  # any name may be bound later (its columns are checked as they are written)
            prefix = "" if after_space else state.word
            if prefix[:1].isdigit():
                continue  # a number's decimal point
            bound = {q for f in state.stack if f.scope for q in f.declared} | state.ctes
            ok = np.zeros(len(tt.texts), dtype=bool)
            if not prefix:  # a "." after no word: a number's decimal point (`.5`)
                ok[tt.quals.get("", _NONE)] = True
            for b in bound:
                if b.startswith(prefix) and (ids := tt.quals.get(b[len(prefix):])) is not None:
                    ok[ids] = True
            veto += group[~ok[group]].tolist()
        return veto
