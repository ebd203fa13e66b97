"""Streaming detokenizer: token ids in, text deltas out, never half a UTF-8 character."""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence


class ByteLevelStream:
    """For byte-level BPE vocabularies: each token is a fixed byte string, so decode bytes incrementally.

    `token_bytes[id]` is the id's bytes, or None for a token skipped in the output.
    """

    def __init__(self, token_bytes: Sequence[bytes | None]):
        self._token_bytes = token_bytes
        self._pending = b""  # an incomplete trailing UTF-8 sequence, completed by the next bytes

    def push(self, token_id: int) -> str:
        if not 0 <= token_id < len(self._token_bytes):
            raise ValueError(f"token id {token_id} is outside the vocabulary (0..{len(self._token_bytes) - 1})")
        data = self._token_bytes[token_id]
        if data is None:
            return ""
        if self._pending:
            data = self._pending + data
        # what codecs' incremental UTF-8 decoder does, without its Python wrapper: decode what is complete, keep the rest
        text, used = codecs.utf_8_decode(data, "replace", False)
        self._pending = data[used:]
        return text

    def flush(self) -> str:
        """Text still held back (an unfinished character becomes U+FFFD, as in a full decode)."""
        text, _ = codecs.utf_8_decode(self._pending, "replace", True)
        self._pending = b""
        return text


class WindowedStream:
    """For any other decoder: re-decode a short window and emit what grew, holding back U+FFFD tails."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the window that gives context (e.g. a leading space)
        self._read_offset = 0  # ids up to here have had their text emitted

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return delta
        return ""

    def flush(self) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text):]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level map: every byte to a printable unicode character."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))
