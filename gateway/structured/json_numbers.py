"""Finite numbers in JSON output: a decoding guard that bounds every number to a finite double.

llguidance's JSON number lexeme admits any exponent (`1125e2755992` parses to inf) and its bounded
ranges cannot reach 1e308, so the Constraint filters each mask row with `FiniteNumberGuard`: outside
strings, a number's significant integer digits plus its exponent stay <= 308 and its exponent has at
most three digits (so it is below 1e308 and never overflows; tiny values round to 0, still finite).
It applies to every number, typed or not (`{}`, open objects, json_object).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import numpy as np

from .bitmask import row_allows
from .vocab import TokenizerInfo

MAX_DECIMAL_EXPONENT = 308  # 1e308 < DBL_MAX ~ 1.797e308
MAX_EXPONENT_DIGITS = 3
NONE = np.zeros(0, dtype=np.int64)
MEMO_ENTRIES = 20_000  # completion-search states remembered between two consumed tokens
_DIGITS = frozenset(b"0123456789")
_STARTS = frozenset(b'"-0123456789')


class _Overflow(Exception):
    pass


@dataclass(frozen=True)
class _Lexer:
    """Where the output is, byte by byte: inside a string, inside a number (which part), or between."""

    in_string: bool = False
    escape: bool = False
    part: str = ""  # "" (no number) | int | frac | exp0 (after e) | exp (sign or digits seen)
    int_digits: int = 0  # significant digits before the point
    exp_negative: bool = False
    exp_value: int = 0
    exp_digits: int = 0

    def feed(self, data: bytes) -> _Lexer:
        if self.in_string and not self.escape and b'"' not in data and b"\\" not in data:
            return self  # stays inside the string
        if not self.in_string and not self.part and not _STARTS.intersection(data):
            return self  # between values, no string or number starts
        s = self
        for b in data:
            s = s._step(b)
        return s

    def _step(self, b: int) -> _Lexer:
        if self.in_string:
            if self.escape:
                return replace(self, escape=False)
            if b == 0x5C:  # backslash
                return replace(self, escape=True)
            return replace(self, in_string=b != 0x22)
        if self.part:
            if b in _DIGITS:
                return self._digit(b - 0x30)
            if b == 0x2E and self.part == "int":
                return replace(self, part="frac")
            if b in (0x65, 0x45) and self.part in ("int", "frac"):
                return replace(self, part="exp0")
            if b in (0x2B, 0x2D) and self.part == "exp0":
                return replace(self, part="exp", exp_negative=b == 0x2D)
            self = _Lexer()  # the number ended at this byte  # noqa: PLW0642
        if b == 0x22:
            return replace(self, in_string=True)
        if b == 0x2D:
            return _Lexer(part="int")
        if b in _DIGITS:
            return _Lexer(part="int")._digit(b - 0x30)
        return self

    def _digit(self, d: int) -> _Lexer:
        if self.part == "int":
            n = self.int_digits + (1 if self.int_digits or d else 0)
            if n > MAX_DECIMAL_EXPONENT:
                raise _Overflow
            return replace(self, int_digits=n)
        if self.part == "frac":
            return self
        value, digits = self.exp_value * 10 + d, self.exp_digits + 1
        if digits > MAX_EXPONENT_DIGITS or (not self.exp_negative and self.int_digits + value > MAX_DECIMAL_EXPONENT):
            raise _Overflow
        return replace(self, part="exp", exp_value=value, exp_digits=digits)

    @property
    def in_number(self) -> bool:
        return bool(self.part)


@dataclass(frozen=True)
class _Tables:
    risky_ids: np.ndarray  # tokens that overflow on their own, from between values or inside a string
    digit_ids: np.ndarray  # tokens with a digit: the only ones that can make a number overflow
    exp_digit_ids: np.ndarray  # those of them with an 'e' / 'E' (they can open an exponent)
    max_digits: int  # the most digits one token has
    has_digit: np.ndarray  # [V] bool
    pieces: tuple[bytes, ...]


@functools.lru_cache(maxsize=8)
def _tables(tokenizer: TokenizerInfo) -> _Tables:
    pieces = tuple(b or b"" for b in tokenizer.token_bytes)
    has_digit = np.zeros(len(pieces), dtype=bool)
    risky = []
    fresh = (_Lexer(), _Lexer(in_string=True))
    for i, p in enumerate(pieces):
        if not p or not _DIGITS.intersection(p):
            continue
        has_digit[i] = True
        if sum(c in _DIGITS for c in p) > MAX_EXPONENT_DIGITS:
            for state in fresh:
                try:
                    state.feed(p)
                except _Overflow:
                    risky.append(i)
                    break
    digit_ids = np.flatnonzero(has_digit)
    exp_ids = np.array([i for i in digit_ids.tolist() if b"e" in pieces[i] or b"E" in pieces[i]], dtype=np.int64)
    max_digits = max((sum(c in _DIGITS for c in pieces[i]) for i in digit_ids.tolist()), default=0)
    return _Tables(np.array(risky, dtype=np.int64), digit_ids, exp_ids, max_digits, has_digit, pieces)


class FiniteNumberGuard:
    """Per-sequence guard with the Constraint's guard interface: `consume`, `filter`, `allows`, `allows_end`."""

    def __init__(self, tokenizer: TokenizerInfo, start_ids: tuple[int, ...] = ()) -> None:
        """`start_ids`: tokens that open a JSON part (the tool-call token); the guard then watches
        only after one of them, from a fresh state (free text before it may hold stray quotes)."""
        self.tables = _tables(tokenizer)
        self.state = _Lexer()
        self.start_ids = frozenset(start_ids)
        self.active = not start_ids
        self._memo: dict[tuple[int, ...], _Lexer] = {}

    def _piece(self, token: int) -> bytes:
        return self.tables.pieces[token] if token < len(self.tables.pieces) else b""

    def consume(self, token: int) -> None:
        self._memo.clear()
        if token in self.start_ids:
            self.state, self.active = _Lexer(), True
            return
        if not self.active:
            return
        try:
            self.state = self.state.feed(self._piece(token))
        except _Overflow:  # only reachable if a vetoed token was forced in; validation reports it
            self.state = _Lexer()

    def allows(self, tokens: list[int], final: bool = False) -> bool:
        """Whether `tokens` after the output so far keep every number finite. The completion search
        asks for each path it extends by one move, so the state after each path is memoised."""
        key = tuple(tokens)
        state = None
        for cut in range(len(key) - 1, max(-1, len(key) - 9), -1):  # the longest memoised prefix
            state = self._memo.get(key[:cut]) if cut else self.state
            if state is not None:
                break
        if state is None:
            state, cut = self.state, 0
        try:
            for t in key[cut:]:
                state = _Lexer() if t in self.start_ids else state.feed(self._piece(t))
        except _Overflow:
            return False
        if len(self._memo) < MEMO_ENTRIES:
            self._memo[key] = state
        return True

    def allows_end(self) -> bool:
        return True

    def _candidates(self) -> np.ndarray:
        """The tokens (ascending ids) that could make a number overflow from this state: the only ones fed."""
        state, tables = self.state, self.tables
        if not self.active:
            return NONE
        if not state.in_number:
            return tables.risky_ids
        if state.part in ("int", "frac") and state.int_digits + tables.max_digits <= MAX_DECIMAL_EXPONENT:
            return tables.exp_digit_ids  # more digits cannot overflow here; an exponent might
        return tables.digit_ids

    def _overflows(self, token: int) -> bool:
        try:
            self.state.feed(self.tables.pieces[token])
        except _Overflow:
            return True
        return False

    def filter(self, out: np.ndarray) -> None:
        """Clear, in mask row `out` (uint32 words), the tokens that would make a number overflow."""
        candidates = self._candidates()
        for t in candidates[row_allows(out, candidates)].tolist():
            if self._overflows(t):
                out[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)

    def keeps(self, tokens: np.ndarray) -> np.ndarray:
        """Whether `filter` keeps each of `tokens` (int64 ids) in a row that allows it."""
        digit = self.tables.has_digit  # (every candidate holds a digit: a few checks in one state cost no search)
        if not self.active or (len(tokens) and tokens.max() < len(digit) and not digit[tokens].any()):
            return np.ones(len(tokens), dtype=bool)
        candidates = self._candidates()
        at = np.minimum(np.searchsorted(candidates, tokens), max(len(candidates) - 1, 0))
        fed = candidates[at] == tokens if len(candidates) else np.zeros(len(tokens), dtype=bool)
        return np.array([not (f and self._overflows(t)) for t, f in zip(tokens.tolist(), fed.tolist(), strict=True)],
                        dtype=bool)

    def keeps_one(self, token: int) -> bool:
        """`keeps` of one id without its arrays (~1 us against ~15): the lazy checks ask it for each candidate."""
        digit = self.tables.has_digit
        if not self.active or (token < len(digit) and not digit[token]):
            return True
        candidates = self._candidates()
        if not len(candidates):
            return True
        at = min(int(candidates.searchsorted(token)), len(candidates) - 1)
        return not (candidates[at] == token and self._overflows(token))
