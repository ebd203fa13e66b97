"""Per-tokenizer token tables for the SQL scope guard (sql_guard.py): each token's text split where
the scope tracker can react (its head up to the last non-identifier byte, the identifier before and
after it), the heads as the tracker reads them (_canonical), and cached token-set masks over them.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, fields

import numpy as np

from .sql_scope import _CLAUSE_END, _ID, _QUOTE_CLOSE, WordPool
from .vocab import TokenizerInfo

_QUAL_HEAD = re.compile(r"^[ \t\r\n]*([A-Za-z0-9_]*)\.$")
_HOT_CHARS = frozenset(".);'\"`[]")
_QUOTE_OPEN = ('"', "`", "[")
_SAFE_HEAD = frozenset(" \t\r\n=<>!+-*/%|(")  # a head of these changes no scope: only where a word starts
# Words whose completion can end a FROM clause or a scope (the others cannot veto, except aliases).
RELEVANT = _CLAUSE_END | {"select"}


@dataclass(frozen=True, eq=False)
class TokenTable:
    """Per-tokenizer arrays that let `SQLScopeGuard.filter` simulate only the tokens that can veto."""

    texts: list[str]  # per id: its bytes as latin-1 text
    lower: list[str]  # the same, lower case
    delim: np.ndarray  # [V] bool: holds a non-identifier byte
    dots: np.ndarray  # [V] bool: holds a "."
    hot: np.ndarray  # [V] bool: its head holds . ) ; a quote, or completes a word of RELEVANT inside it
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
    ids: np.ndarray | None = None  # a subset's token ids (index j is token ids[j]); None: the whole vocabulary
    memo: dict | None = None  # a one-token table's `_per_table` results (None: not kept)

    def subset(self, ids: np.ndarray) -> TokenTable:
        """The table of the tokens `ids` alone, indexed 0..len(ids)-1 (a few candidates filtered without
        vocabulary-wide arrays); heads, canons and rests stay this table's (head / canon / rest index them).
        One token's table is kept (`_one_token`: the lazy check asks the same tokens again and again)."""
        if ids.size == 1 and self.ids is None:
            return _one_token(self, int(ids[0]))
        return self._subset(ids)

    def _subset(self, ids: np.ndarray, memo: dict | None = None) -> TokenTable:
        picked = ids.tolist()
        values = _key_dicts([self.texts[i] for i in picked])
        for name in _FIELDS:
            v = getattr(self, name)
            values[name] = (ids if name == "ids" else memo if name == "memo"
                            else [v[i] for i in picked] if name in ("texts", "lower")
                            else tuple(a[ids] for a in v) if name == "canon"
                            else v[ids] if isinstance(v, np.ndarray) else v)
        return TokenTable(**values)


# One-token tables kept per (table, token): a few KB each
ONE_TOKEN_TABLES = 2048
MEMO_ENTRIES = 64  # `_per_table` results kept per one-token table (cleared when full)


@functools.lru_cache(maxsize=ONE_TOKEN_TABLES)
def _one_token(tt: TokenTable, token: int) -> TokenTable:
    return tt._subset(np.array([token], dtype=np.int64), memo={})


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


def _per_table(maxsize: int):
    """lru_cache for a function of (table, ...) on the whole-vocabulary table; a kept one-token table keeps its
    own (`TokenTable.memo`, apart: it evicts none of the whole table's); another subset's (a few tokens, a new
    table each time) is computed directly."""
    def wrap(fn):
        cached = functools.lru_cache(maxsize=maxsize)(fn)

        @functools.wraps(fn)
        def call(tt: TokenTable, *args):
            if tt.ids is None:
                return cached(tt, *args)
            if tt.memo is None:
                return fn(tt, *args)
            key = (fn, *args)
            if (found := tt.memo.get(key)) is None:
                if len(tt.memo) >= MEMO_ENTRIES:
                    tt.memo.clear()
                found = tt.memo[key] = fn(tt, *args)
            return found
        return call
    return wrap


def _keys(t: str) -> tuple[str | None, list[str], str | None, str | None, str | None]:
    """Token text `t` -> its keys in TokenTable's dicts: (leads, inners, quals, idents, tails), None where absent."""
    cuts = [k for k, ch in enumerate(t) if ch not in _ID]
    if not cuts:
        return None, [], None, t.lower() if t else None, None
    h = t[: cuts[-1] + 1]
    inner = [t[a + 1:c].lower() for a, c in zip(cuts, cuts[1:], strict=False) if c > a + 1]
    qual = m.group(1).lower() if (m := _QUAL_HEAD.match(h)) and "." not in t[len(h):] else None
    return t[: cuts[0]].lower(), inner, qual, None, t[len(h):].lower() or None


_DICTS = ("leads", "inners", "quals", "idents", "tails")
_FIELDS = tuple(f.name for f in fields(TokenTable) if f.name not in _DICTS)


def _key_dicts(texts: list[str]) -> dict[str, dict[str, np.ndarray]]:
    """TokenTable's dicts over `texts` (key -> the indices of the texts that have it)."""
    found: dict[str, dict[str, list[int]]] = {name: {} for name in _DICTS}
    for i, t in enumerate(texts):
        lead, inner, qual, ident, tail = _keys(t)
        for name, keys in zip(_DICTS, ([lead], inner, [qual], [ident], [tail]), strict=True):
            for k in keys:
                if k is not None:
                    found[name].setdefault(k, []).append(i)
    return {name: {k: np.array(v, dtype=np.int64) for k, v in d.items()} for name, d in found.items()}


@functools.lru_cache(maxsize=8)
def token_table(tokenizer: TokenizerInfo) -> TokenTable:
    texts, index, nindex, rindex = [], {}, {}, {}
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
            continue
        h = t[: cuts[-1] + 1]
        delim[i], dots[i] = True, "." in t
        lead_empty[i], first_dot[i] = cuts[0] == 0, t[cuts[0]] == "."
        if tail := t[len(h):].lower():
            tailed[i], digit_tail[i] = True, tail[0].isdigit()
            body = h.rstrip(" \t\r\n")
            tail_at[i] = 0 if not body else 1 if body[-1] in _ID else ord(body[-1])
            safe[i], safe_comma[i] = set(h) <= _SAFE_HEAD, set(h) <= _SAFE_HEAD | {","}
        words = [t[a + 1:c].lower() for a, c in zip(cuts, cuts[1:], strict=False) if c > a + 1]
        hot[i] = bool(_HOT_CHARS & set(h)) or any(w in RELEVANT for w in words)
        head[i] = index.setdefault(h, len(index))
        rest[i] = rindex.setdefault(h[cuts[0]:], len(rindex))
        canon_out[i] = nindex.setdefault(_canonical(h, False), len(nindex))
        canon_in[i] = nindex.setdefault(_canonical(h, True), len(nindex))
        if _QUAL_HEAD.match(h) and "." not in t[len(h):]:
            qual[i] = 1
    d = _key_dicts(texts)
    return TokenTable(texts, [t.lower() for t in texts], delim, dots, hot, head, list(index), (canon_out, canon_in),
                       list(nindex),
                       rest, list(rindex),
                       d["leads"],
                       d["inners"], qual, d["quals"], d["idents"], d["tails"], tailed, tail_at,
                       safe, safe_comma, lead_empty, first_dot, digit_start, digit_tail,
                       np.array([t[:1] in _QUOTE_OPEN for t in texts], dtype=bool),
                       np.array([any(q in t for q in '"`[]') for t in texts], dtype=bool),
                       np.array(["," in t or ")" in t for t in texts], dtype=bool),
                       np.array(["(" in t and ("," in t[t.index("("):] or ")" in t[t.index("("):]) for t in texts],
                                dtype=bool),
                       np.array([any(c.isdigit() for c in t) for t in texts], dtype=bool))


def _byte_set(codes: list[int]) -> np.ndarray:
    """[256] bool: `codes` set (a lookup by a uint8 array; np.isin sorts, ~0.2 ms on a few tokens)."""
    found = np.zeros(256, dtype=bool)
    found[codes] = True
    return found


@_per_table(maxsize=64)
def tail_checks(tt: TokenTable, before_operand: frozenset[str]) -> np.ndarray:
    """[V] bool: tokens whose identifier after the last non-identifier byte may start a checked word
    (the head ends in punctuation that may precede an operand, or in a word or whitespace)."""
    return tt.tailed & _byte_set([0, 1] + [ord(c) for c in before_operand if len(c) == 1])[tt.tail_at]


@_per_table(maxsize=64)
def tail_classes(tt: TokenTable, before_operand: frozenset[str], after: frozenset[str]) -> dict[str, np.ndarray]:
    """Tokens with an identifier after their head, by the punctuation before it ("" for whitespace),
    one class per pool: the bytes with words of their own (in `after`), and one for the rest."""
    own = sorted(c for c in after if len(c) == 1 and c in before_operand)
    rest = sorted(c for c in before_operand if len(c) == 1 and c not in own)
    classes = {"": tt.tailed & (tt.tail_at == 0)}
    classes |= {c: tt.tailed & (tt.tail_at == ord(c)) for c in own}
    if rest:
        classes[rest[0]] = tt.tailed & _byte_set([ord(c) for c in rest])[tt.tail_at]
    return classes


NONE = np.zeros(0, dtype=np.int64)


@functools.lru_cache(maxsize=256)
def _pieces(words: frozenset[str], word: str) -> frozenset[str]:
    """The non-empty texts after which `word` is still a prefix of one of `words`."""
    n = len(word)
    return frozenset(w[n:k] for w in words if w.startswith(word) for k in range(n + 1, len(w) + 1))


def _lookup(table: dict[str, np.ndarray], keys: frozenset[str]) -> list[np.ndarray]:
    """The id arrays of `keys` in `table`, walking the smaller of the two (a subset's dicts hold a few keys)."""
    if len(table) < len(keys):
        return [ids for k, ids in table.items() if k in keys]
    return [ids for k in keys if (ids := table.get(k)) is not None]


def _word_ids(tt: TokenTable, pool: WordPool, word: str) -> np.ndarray:
    """Tokens that keep `word` a prefix of a word of `pool`: identifier-only ones that extend it, and
    ones whose leading identifier completes it (before a "." only as a qualifier)."""
    n, ids = len(word), _lookup(tt.idents, _pieces(pool.words, word))
    for a in pool.words:
        if len(a) > n and a.startswith(word) and (x := tt.leads.get(a[n:])) is not None:
            ids.append(x if a in pool.ends else x[tt.first_dot[x]])
    return np.concatenate(ids) if ids else NONE


@_per_table(maxsize=256)
def extending(tt: TokenTable, words: frozenset[str], word: str) -> np.ndarray:
    """[V] bool: identifier-only tokens after which `word` is still a prefix of one of `words`."""
    ok = np.zeros(len(tt.texts), dtype=bool)
    for ids in _lookup(tt.idents, _pieces(words, word)):
        ok[ids] = True
    return ok


@_per_table(maxsize=64)
def word_mask(tt: TokenTable, pool: WordPool, word: str) -> np.ndarray:
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


@_per_table(maxsize=64)
def tail_mask(tt: TokenTable, pool: WordPool) -> np.ndarray:
    """[V] bool: tokens whose identifier after their last non-identifier byte starts a word of
    `pool` (or a number)."""
    ok = tt.digit_tail.copy()
    if ids := _lookup(tt.tails, _pieces(pool.words, "")):
        ok[np.concatenate(ids)] = True
    return ok
