"""The fixed token sets of the Constraint's own rules (beside the grammar's) for one tokenizer: the closing tiers
(JSON's, SQL's per open quote), EOS, whitespace and the dead-end witnesses; as id tuples and read-only bitmask
rows, cached per tokenizer."""

from __future__ import annotations

import functools

import numpy as np

from .bitmask import ids_to_row
from .vocab import TokenizerInfo

# Tokens that close an open construct, by preference tier (bytes allowed, required first byte);
# when the token budget is nearly spent the first tier with an allowed token wins: a quote that
# ends a JSON string, then JSON closers, then SQL's, then a separator (ends a number or value
# when required members remain).
CLOSING_TIERS = ((b'"}]', b'"'), (b'"}]', b""), (b")'", b"'"), (b")'", b""), (b",", b","))
# SQL: only what ends the open string or quoted name (its closing quote, then `)`s), then `)`s alone.
# `"` and `,` close nothing there: outside quotes they open a string or quoted name and a new item.
SQL_CLOSING_TIERS = {mode: ((b")" + mode.encode(), mode.encode()),) for mode in ("'", '"', "`", "]")}
SQL_PAREN_TIER = (b")", b")")


@functools.lru_cache(maxsize=8)
def whitespace_ids(tokenizer: TokenizerInfo) -> tuple[int, ...]:
    return tuple(i for i, b in enumerate(tokenizer.token_bytes) if b and not b.strip())


@functools.lru_cache(maxsize=16)
def closer_ids(tokenizer: TokenizerInfo, closing: bytes, first: bytes) -> tuple[int, ...]:
    allowed = set(closing)
    return tuple(i for i, b in enumerate(tokenizer.token_bytes)
                 if b and set(b) <= allowed and b.startswith(first))


@functools.lru_cache(maxsize=8)
def witness_ids(tokenizer: TokenizerInfo) -> tuple[int, ...]:
    """The one-byte tokens ";", " " and newline: after almost any text one of them may follow, so one the grammar
    allows and the guard keeps shows that a row is no dead end (LazyCheck._guard_leaves_some)."""
    return tuple(i for i, b in enumerate(tokenizer.token_bytes) if b in (b";", b" ", b"\n"))


@functools.lru_cache(maxsize=32)
def special_rows(tokenizer: TokenizerInfo, eos_ids: tuple[int, ...], n_words: int):
    """(EOS row, closing tiers, whitespace row) as uint32 [n_words] bitmask rows; shared, read-only."""
    tiers = [ids_to_row(closer_ids(tokenizer, c, f), n_words) for c, f in CLOSING_TIERS]
    rows = (ids_to_row(eos_ids, n_words), tiers, ids_to_row(whitespace_ids(tokenizer), n_words))
    for row in (rows[0], *tiers, rows[2]):
        row.flags.writeable = False
    return rows


def sql_tiers(mode: str) -> tuple[tuple[bytes, bytes], ...]:
    """SQL's closing tiers inside `mode` (the scope tracker's open quote: its closing char, "" outside quotes)."""
    return (*SQL_CLOSING_TIERS.get(mode, ()), SQL_PAREN_TIER) if mode else (SQL_PAREN_TIER,)


@functools.lru_cache(maxsize=32)
def sql_closer_rows(tokenizer: TokenizerInfo, mode: str, n_words: int) -> tuple[np.ndarray, ...]:
    """SQL's closing tiers inside `mode` as read-only bitmask rows."""
    rows = tuple(ids_to_row(closer_ids(tokenizer, c, f), n_words) for c, f in sql_tiers(mode))
    for row in rows:
        row.flags.writeable = False
    return rows
