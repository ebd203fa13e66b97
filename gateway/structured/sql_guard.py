"""Per-token SQL scope guard: filters each constrained-decoding mask row with the scope tracker of
sql_scope.py, simulating only the tokens that can veto (grouped by their text up to the last
non-identifier byte) and testing identifier-only tokens by prefix masks.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
from dataclasses import dataclass

import numpy as np

from .sql_closing import closing_texts
from .sql_scope import (
    _BANNED,
    _CLAUSE_END,
    _ID,
    _QUOTE_CLOSE,
    SCHEMA_COMMENT,
    WORDS_COMMENT,
    SQLScope,
    SQLWords,
    WordPool,
    _Veto,
)
from .vocab import TokenizerInfo

_QUAL_HEAD = re.compile(r"^[ \t\r\n]*([A-Za-z0-9_]*)\.$")
_HOT_CHARS = frozenset(".);'\"`[]")
_QUOTE_OPEN = ('"', "`", "[")
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
    canon: tuple[np.ndarray, np.ndarray]  # [V] int each: index into canons of its head as the scope
    canons: list[str]  # tracker reads it from outside / inside a '...' string (_canonical): one simulation
    rest: np.ndarray  # [V] int: index into rests of its head after its leading identifier
    rests: list[str]
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
    quote_start: np.ndarray  # [V] bool: starts with an identifier quote (" ` [)
    quotes: np.ndarray  # [V] bool: holds an identifier quote (" ` [ ])
    arg_marks: np.ndarray  # [V] bool: holds "," or ")"
    call_marks: np.ndarray  # [V] bool: holds "(" and after it "," or ")"
    has_digit: np.ndarray  # [V] bool: holds a digit


def _canonical(head: str, in_string: bool) -> str:
    """`head` as the scope tracker reads it (starting inside a '...' string or not): a string's
    content as one "a" (only its closing quote counts), each whitespace run outside quotes as one byte:
    a newline where the run ends in one (a fence needs it right before the backtick), else a space (a
    run ends a word, the tracker reads no other difference); names in quotes as is."""
    out, mode, gap = [], "'" if in_string else "", ""
    for ch in head:
        if mode == "'":
            if ch == "'":
                mode = ""
                out.append(ch)
            elif out[-1:] != ["a"]:
                out.append("a")
        elif mode:
            out.append(ch)
            mode = "" if ch == mode else mode
        elif ch in " \t\r\n":
            gap = "\n" if ch == "\n" else " "
        else:
            out.append(gap + ch)
            gap = ""
            if ch == "'":
                mode = "'"
                out.append("")  # (the string's content follows)
            elif ch in _QUOTE_CLOSE:
                mode = _QUOTE_CLOSE[ch]
    return "".join(out) + gap


@functools.lru_cache(maxsize=8)
def _token_table(tokenizer: TokenizerInfo) -> _TokenTable:
    texts, index, nindex, rindex, leads, inners, quals, idents, tails = [], {}, {}, {}, {}, {}, {}, {}, {}
    n = tokenizer.vocab_size
    delim, dots, hot, tailed, lead_empty, first_dot, digit_start, digit_tail = (
        np.zeros(n, dtype=bool) for _ in range(8))
    tail_at = np.zeros(n, dtype=np.uint8)
    safe, safe_comma = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
    qual = np.full(n, -1, dtype=np.int64)
    head, rest, canon_out, canon_in = (np.zeros(n, dtype=np.int64) for _ in range(4))
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
        rest[i] = rindex.setdefault(h[cuts[0]:], len(rindex))
        canon_out[i] = nindex.setdefault(_canonical(h, False), len(nindex))
        canon_in[i] = nindex.setdefault(_canonical(h, True), len(nindex))
        leads.setdefault(t[: cuts[0]].lower(), []).append(i)
        if (m := _QUAL_HEAD.match(h)) and "." not in t[len(h):]:
            qual[i] = 1
            quals.setdefault(m.group(1).lower(), []).append(i)
    def arrays(d: dict[str, list[int]]) -> dict[str, np.ndarray]:
        return {k: np.array(v, dtype=np.int64) for k, v in d.items()}

    return _TokenTable(texts, [t.lower() for t in texts], delim, dots, hot, head, list(index), (canon_out, canon_in),
                       list(nindex),
                       rest, list(rindex),
                       arrays(leads),
                       arrays(inners), qual, arrays(quals), arrays(idents), arrays(tails), tailed, tail_at,
                       safe, safe_comma, lead_empty, first_dot, digit_start, digit_tail,
                       np.array([t[:1] in _QUOTE_OPEN for t in texts], dtype=bool),
                       np.array([any(q in t for q in '"`[]') for t in texts], dtype=bool),
                       np.array(["," in t or ")" in t for t in texts], dtype=bool),
                       np.array(["(" in t and ("," in t[t.index("("):] or ")" in t[t.index("("):]) for t in texts],
                                dtype=bool),
                       np.array([any(c.isdigit() for c in t) for t in texts], dtype=bool))


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


def _trie_members(node: dict) -> np.ndarray:
    """The members of every head at or below a trie node of SQLScopeGuard._simulate."""
    found, stack = [], [node]
    while stack:
        n = stack.pop()
        found += [v for k, v in n.items() if not k]
        stack += [v for k, v in n.items() if k]
    return np.concatenate(found) if found else _NONE


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


@functools.lru_cache(maxsize=256)
def _extending(tt: _TokenTable, words: frozenset[str], word: str) -> np.ndarray:
    """[V] bool: identifier-only tokens after which `word` is still a prefix of one of `words`."""
    ok = np.zeros(len(tt.texts), dtype=bool)
    n = len(word)
    for piece in {w[n:k] for w in words if w.startswith(word) for k in range(n + 1, len(w) + 1)}:
        if (ids := tt.idents.get(piece)) is not None:
            ok[ids] = True
    return ok


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
        self.tokenizer = tokenizer

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
        with contextlib.suppress(_Veto):  # only reachable if a vetoed token was forced in; validation reports it
            self.scope.feed(self._text(token))

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

    def closing_moves(self, tokens: list[int] = ()) -> tuple[tuple[int, ...], ...]:
        """Token sequences that, after `tokens` (following the text so far), bind the names the
        innermost scope left unbound (sql_closing.closing_texts), for the completion search to try first."""
        state = self.scope
        if tokens or (state.word and not state.mode):
            state = state.clone()
            try:  # (the texts start with a byte that ends the word being written)
                state.feed("".join(self._text(t) for t in tokens) + (" " if state.word and not state.mode else ""))
            except _Veto:
                return ()
        return tuple(tuple(self.tokenizer.encode(t)) for t in closing_texts(state))

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
        if s.dot_q is not None and (columns := s.columns_for(s.dot_q, quoted=bool(s.mode))) is None:
            # any name (FROM may declare q as a derived table that has it): identifier-only tokens go on
            # with it, the others end it with their leading identifier
            named = np.flatnonzero(keep & ~tt.lead_empty)
            keep &= tt.lead_empty
            drop[self._any_name_heads(named)] = True
        elif s.dot_q is not None:  # identifier-only tokens extend the column name: a prefix test
            drop[: len(bits)] |= bits & ~tt.delim & ~_extending(tt, frozenset(columns), s.word)
            if not s.mode:  # (inside quotes every other token is simulated)
                ends = np.zeros(len(tt.texts), dtype=bool)  # tokens whose leading identifier ends a column
                for c in columns:
                    if c.startswith(s.word) and (ids := tt.leads.get(c[len(s.word):])) is not None:
                        ends[ids] = True
                if not s.word:  # a quoted column name may start
                    ends |= tt.quote_start
                drop[: len(keep)] |= keep & ~ends
                keep &= ends
        elif s.mode and s.mode != s.string:  # inside a quoted name: the few tokens the grammar allows there
            if s.pool is None:  # unchecked until its closing quote (SQLite's "...": a name or a string)
                keep &= tt.quotes
            else:
                drop[: len(bits)] |= bits & ~tt.delim & ~_extending(tt, s.pool.words, s.word)
        else:
            if (pool := s.pool if s.word else s.word_pool()) is not None:
                ok = _word_mask(tt, pool, s.word)
                drop[: len(bits)] |= bits & ~ok
                keep &= ok
            pending = {q for f in s.stack if f.scope for q in f.pending}
            # names used before a FROM (or the word being written, if it becomes one) may be unbound
            unsettled = any(f.scope and (f.pending or f.bare or f.phase in ("start", "select")) for f in s.stack)
            if not unsettled:
                sim = tt.dots | tt.quotes
            else:
                sim = tt.hot | tt.quotes
                for w in pending:
                    if (ids := tt.inners.get(w)) is not None:
                        sim[ids] = True
                in_from = any(f.scope and f.phase == "from" for f in s.stack)
                for w in _RELEVANT | pending | ({s.word} if in_from else set()):
                    if w.startswith(s.word) and (ids := tt.leads.get(w[len(s.word):])) is not None:
                        sim[ids] = True
            checks = keep & _tail_checks(tt, s.words.before_operand) if s.words is not None and not s.mode else None
            if s.in_by_list():  # a number there is an output column's position (SQLScope.ordinal_ok)
                sim |= tt.has_digit
                if checks is not None:
                    checks &= ~tt.has_digit
                if not s.word or s.word[:1].isdigit():
                    numbers = np.flatnonzero(bits & ~tt.delim & tt.digit_start)
                    drop[[t for t in numbers.tolist() if not s.ordinal_ok(s.word + tt.texts[t])]] = True
            if checks is not None:  # the identifier after the head may start a checked word
                drop[self._safe_tails(np.flatnonzero(checks), sim)] = True
            if any(f.func for f in s.stack):  # argument counts: "," and ")" may veto
                sim |= tt.arg_marks
            elif s.words is not None and (s.word or s.at) in s.words.arity:  # a call opened and closed by one token
                sim |= tt.call_marks
            if not s.mode and unsettled:
                # a word that may not become a clause keyword yet (SQLScope._bans)
                if bans := (s.banned if s.word else s._bans()):
                    probe = s if s.word else s.clone()
                    probe.banned = bans
                    for k in bans:
                        for end in range(len(s.word) + 1, len(k) + 1):
                            if k.startswith(s.word) and probe.only_banned(k[:end]) \
                                    and (ids := tt.idents.get(k[len(s.word):end])) is not None:
                                drop[ids] = True
                for k in _BANNED:  # tokens whose identifier tail may start one: simulated below
                    for end in range(1, len(k) + 1):
                        if (ids := tt.tails.get(k[:end])) is not None:
                            sim[ids] = True
            keep &= sim
        cands = np.flatnonzero(keep)
        fast = (tt.qual[cands] >= 0) & ~tt.tailed[cands]  # `q.` with nothing after the dot
        drop[self._qualifier_heads(cands, fast)] = True
        cands = cands[~fast]
        string = s.mode == "'" and s.string == "'"
        canon = tt.canon[1] if string else tt.canon[0] if not s.mode else tt.head
        heads = canon[cands]
        order = np.argsort(heads, kind="stable")
        cands, heads = cands[order], heads[order]
        starts = np.flatnonzero(np.r_[True, heads[1:] != heads[:-1]])
        groups = zip(heads[starts].tolist(), np.split(cands, starts[1:]), strict=True) if cands.size else ()
        texts = tt.heads if s.mode and not string else tt.canons
        self._simulate([(texts[h], members) for h, members in groups], drop)
        out &= ~np.packbits(drop, bitorder="little").view(np.uint32)

    def _any_name_heads(self, ids: np.ndarray) -> list[int]:
        """Vetoes among tokens (ids) that end a name any of which may follow `q.` with their leading
        identifier: simulated by what follows it (one stand-in name per group where that is punctuation
        only; one by one where it holds another word)."""
        tt, drop = self.table, np.zeros(len(self.table.texts), dtype=bool)
        if not ids.size:
            return []
        rests = tt.rest[ids]
        order = np.argsort(rests, kind="stable")
        ids, rests = ids[order], rests[order]
        starts = np.flatnonzero(np.r_[True, rests[1:] != rests[:-1]])
        heads: list[tuple[str, np.ndarray]] = []
        for r, members in zip(rests[starts].tolist(), np.split(ids, starts[1:]), strict=True):
            rest = tt.rests[r]
            if any(ch in _ID for ch in rest):
                heads += [(tt.texts[t][: len(tt.heads[tt.head[t]])], np.array([t])) for t in members.tolist()]
            else:
                heads.append(("x" + rest, members))
        self._simulate(heads, drop)
        return np.flatnonzero(drop).tolist()

    def _simulate(self, heads: list[tuple[str, np.ndarray]], drop: np.ndarray) -> None:
        """Feed each head (the text the tokens `members` share up to their last non-identifier byte)
        and set in `drop` the tokens it vetoes, or whose identifier after it cannot start a word there.
        The heads share their common prefixes: a trie of them walked depth first, each character fed
        once per trie node and the state cloned only where the trie branches."""
        trie: dict = {}
        for head, members in heads:
            node = trie
            for ch in head:
                node = node.setdefault(ch, {})
            node[""] = np.concatenate((node[""], members)) if "" in node else members
        self._walk(trie, self.scope.clone(), drop)

    def _walk(self, node: dict, state: SQLScope, drop: np.ndarray) -> None:
        """`state` has read the text to `node`: rule on the heads that end there, then go on into each
        branch (the last one with `state` itself)."""
        if (members := node.get("")) is not None:
            # (SQLScope.feed's end-of-text check: a half-written word on its way to a banned keyword)
            if state.word and state.banned and not state.mode and state.only_banned(state.word):
                drop[members] = True
            else:
                self._after_head(state, members, drop)
        kids = [ch for ch in node if ch]
        for i, ch in enumerate(kids):
            branch = state if i == len(kids) - 1 else state.clone()
            try:
                branch._char(ch)
            except _Veto:
                drop[_trie_members(node[ch])] = True
                continue
            self._walk(node[ch], branch, drop)

    def _after_head(self, state: SQLScope, members: np.ndarray, drop: np.ndarray) -> None:
        """Set in `drop` the tokens `members` (whose head `state` has read) whose identifier after the
        head cannot start a word there (`state` is left as it was)."""
        tt = self.table
        if state.in_by_list() and (numbers := members[tt.digit_tail[members]]).size:
            drop[[t for t in numbers.tolist() if not state.ordinal_ok(tt.texts[t][len(tt.heads[tt.head[t]]):])]] = True
        if state.mode and state.mode != state.string:  # the tail starts a quoted name
            if state.pool is not None and (tailed := members[tt.tailed[members]]).size:
                drop[[t for t in tailed.tolist() if not state.pool.admits(tt.lower[t][len(tt.heads[tt.head[t]]):])]] = True
        elif state.dot_q is not None:  # the identifier tail starts a column name: a prefix of one
            if (tailed := members[tt.tailed[members]]).size and (cols := state.columns_for(state.dot_q)) is not None:
                pool = WordPool(frozenset(cols), frozenset())
                drop[tailed[~(_tail_mask(tt, pool) & ~tt.digit_tail)[tailed]]] = True
        elif (tailed := members[tt.tailed[members]]).size and not state.word and not state.mode:
            if (pool := state.word_pool()) is not None:
                drop[tailed[~_tail_mask(tt, pool)[tailed]]] = True
            if bans := state._bans():  # (a word after the head may not start as a clause keyword)
                saved, state.banned = state.banned, bans
                pieces = {k[:e] for k in bans for e in range(1, len(k) + 1) if state.only_banned(k[:e])}
                state.banned = saved
                banned = np.zeros(len(tt.texts), dtype=bool)
                for p in pieces:
                    if (ids := tt.tails.get(p)) is not None:
                        banned[ids] = True
                drop[tailed[banned[tailed]]] = True

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
            if prefix[:1].isdigit():  # a number's decimal point (not in an output position)
                veto += [] if state.ordinal_ok(prefix + ".") else group.tolist()
                continue
            bound = {q for f in state.stack if f.scope for q in f.declared}
            ok = np.zeros(len(tt.texts), dtype=bool)
            if not prefix:  # a "." after no word: a number's decimal point (`.5`)
                ok[tt.quals.get("", _NONE)] = True
            for b in bound:
                if b.startswith(prefix) and (ids := tt.quals.get(b[len(prefix):])) is not None:
                    ok[ids] = True
            veto += group[~ok[group]].tolist()
        return veto
