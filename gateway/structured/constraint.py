"""A compiled constraint bound to one sequence: a logits processor plus the batched mask path."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import torch

from .base import CompiledConstraint
from .bitmask import apply_bitmask_, bitmask_words, ids_to_row
from .vocab import TokenizerInfo

# Tokens that close an open construct, by preference tier (bytes allowed, required first byte);
# when the token budget is nearly spent the first tier with an allowed token wins: a quote that
# ends a JSON string, then JSON closers, then SQL's, then a separator (ends a number or value
# when required members remain).
CLOSING_TIERS = ((b'"}]', b'"'), (b'"}]', b""), (b")'", b"'"), (b")'", b""), (b",", b","))


@functools.lru_cache(maxsize=8)
def _whitespace_ids(tokenizer: TokenizerInfo) -> tuple[int, ...]:
    return tuple(i for i, b in enumerate(tokenizer.token_bytes) if b and not b.strip())


@functools.lru_cache(maxsize=16)
def _closer_ids(tokenizer: TokenizerInfo, closing: bytes, first: bytes) -> tuple[int, ...]:
    allowed = set(closing)
    return tuple(i for i, b in enumerate(tokenizer.token_bytes)
                 if b and set(b) <= allowed and b.startswith(first))


@functools.lru_cache(maxsize=32)
def _special_rows(tokenizer: TokenizerInfo, eos_ids: tuple[int, ...], n_words: int):
    """(EOS row, closing tiers, whitespace row) as uint32 [n_words] bitmask rows; shared, read-only."""
    tiers = [ids_to_row(_closer_ids(tokenizer, c, f), n_words) for c, f in CLOSING_TIERS]
    rows = (ids_to_row(eos_ids, n_words), tiers, ids_to_row(_whitespace_ids(tokenizer), n_words))
    for row in (rows[0], *tiers, rows[2]):
        row.flags.writeable = False
    return rows


class Constraint:
    """Per-sequence constraint state. Callable as an engine logits processor.

    EOS ids are allowed only when the constraint accepts; once it is terminated only EOS is.
    Whitespace is bounded: after `max_whitespace_run` consecutive whitespace bytes, whitespace-only
    tokens are masked out (so a grammar with free whitespace cannot loop on it). With `max_tokens`,
    the last `closing_window` steps prefer closing tokens (CLOSING_TIERS) and EOS as soon as the
    output is complete, so output closes inside the budget when it can.
    """

    def __init__(
        self,
        compiled: CompiledConstraint,
        eos_ids: Sequence[int] | None = None,
        max_tokens: int | None = None,
        closing_window: int = 32,
        max_whitespace_run: int = 8,
    ) -> None:
        self.compiled = compiled
        self.matcher = compiled.new_matcher()
        tok = compiled.tokenizer
        self.eos_ids = tuple(eos_ids if eos_ids is not None else tok.eos_ids)
        self.max_tokens, self.closing_window = max_tokens, closing_window
        self.max_whitespace_run = max_whitespace_run
        self._token_bytes = tok.token_bytes
        self._ws_run = 0  # trailing whitespace bytes of the output so far
        self.vocab_size = tok.vocab_size
        self.tok_words = bitmask_words(tok.vocab_size)
        self._scratch: torch.Tensor | None = None
        self.consumed = 0
        self.ended = False  # an EOS id was consumed
        self.error = ""

    # -- state -----------------------------------------------------------------------------
    def advance(self, token_ids: Sequence[int]) -> None:
        """Consume the ids generated since the last call (the engine passes all generated ids)."""
        for token in token_ids[self.consumed:]:
            self.consume(int(token))

    def consume(self, token: int) -> bool:
        self.consumed += 1
        if self.ended or self.error:
            self.error = self.error or f"token {token} after the end of the constrained output"
            return False
        if token in self.eos_ids:
            if not self.matcher.is_accepting():
                self.error = f"EOS {token} before the output was complete"
            self.ended = True
            return not self.error
        if not self.matcher.consume(token):
            self.error = self.matcher.error() or f"token {token} not allowed"
            return False
        piece = self._token_bytes[token] if token < len(self._token_bytes) else None
        if piece:
            stripped = piece.rstrip()
            self._ws_run = self._ws_run + len(piece) if not stripped else len(piece) - len(stripped)
        return True

    def is_accepting(self) -> bool:
        return not self.error and (self.ended or self.matcher.is_accepting())

    def is_terminated(self) -> bool:
        return self.ended or bool(self.error) or self.matcher.is_terminated()

    def _closing(self) -> bool:
        return self.max_tokens is not None and self.max_tokens - self.consumed <= self.closing_window

    # -- masks -----------------------------------------------------------------------------

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write this sequence's allowed ids into bitmask[row] ([B, W] int32, CPU, contiguous)."""
        words = bitmask.shape[1]
        if words < self.tok_words:
            raise ValueError(f"bitmask has {words} words per row, the vocabulary needs {self.tok_words}")
        if not self.is_terminated():
            self.matcher.fill_bitmask(bitmask[row].data_ptr(), words)
        self.finish_row(bitmask, row)

    def finish_row(self, bitmask: torch.Tensor, row: int) -> None:
        """After the backend wrote its words: clear padding, set EOS by acceptance, closing mode."""
        words = bitmask.shape[1]
        out = bitmask[row].numpy().view(np.uint32)  # [W] shares memory with the tensor
        eos_row, closer_tiers, ws_row = _special_rows(self.compiled.tokenizer, self.eos_ids, words)
        if self.is_terminated():
            out[:] = eos_row
            return
        out[self.tok_words:] = 0
        out &= ~eos_row
        if self._ws_run >= self.max_whitespace_run:
            no_ws = out & ~ws_row
            if no_ws.any():
                out[:] = no_ws
        accepting = self.matcher.is_accepting()
        if self._closing():
            if accepting:
                out[:] = eos_row
                return
            for tier in closer_tiers:
                closing = out & tier
                if closing.any():
                    out[:] = closing
                    break
        if accepting:
            out |= eos_row
        if not out.any():  # dead end (matcher error): end the sequence; validation reports it
            self.error = self.error or self.matcher.error() or "no token can continue the output"
            out[:] = eos_row

    def __call__(self, token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        """Logits-processor form: advance by the new ids, then mask logits [V] in place."""
        self.advance(token_ids)
        words = bitmask_words(logits.shape[-1])
        if self._scratch is None or self._scratch.shape[1] != words:
            self._scratch = torch.empty(1, words, dtype=torch.int32)
        self.fill_bitmask(self._scratch, 0)
        apply_bitmask_(logits.view(1, -1), self._scratch)
        return logits
