"""A compiled constraint bound to one sequence: a logits processor plus the batched mask path."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .base import CompiledConstraint, ConstraintKind
from .bitmask import apply_bitmask_, bitmask_words, ids_to_row, only_id
from .closing_planner import ClosingPlanner
from .json_numbers import FiniteNumberGuard
from .lazy_check import LazyCheck
from .sql_guard import SQLScopeGuard
from .token_sets import special_rows, sql_closer_rows


class Constraint(LazyCheck):
    """Per-sequence constraint state. Callable as an engine logits processor.

    EOS ids are allowed only when the constraint accepts; once it is terminated only EOS is.
    Whitespace is bounded: after `max_whitespace_run` consecutive whitespace bytes, whitespace-only
    tokens are masked out (so a grammar with free whitespace cannot loop on it). With `max_tokens`,
    the last `closing_window` steps prefer closing tokens (token_sets.CLOSING_TIERS) and EOS as soon as
    the output is complete. Throughout (llguidance), the closing planner (closing_planner.py) measures a
    completion path and, once the budget requires it, forces that path token by token, so output that
    can close inside the budget does. The sampler's lazy path asks the same rules per token (LazyCheck).
    """

    def __init__(
        self,
        compiled: CompiledConstraint,
        eos_ids: Sequence[int] | None = None,
        max_tokens: int | None = None,
        closing_window: int = 32,
        max_whitespace_run: int = 8,
        closing_margin: int = 4,
        mask_batcher=None,
    ) -> None:
        self.compiled = compiled
        self.matcher = compiled.new_matcher()
        tok = compiled.tokenizer
        self.eos_ids = tuple(eos_ids if eos_ids is not None else tok.eos_ids)
        self.max_tokens, self.closing_window = max_tokens, closing_window
        self.max_whitespace_run = max_whitespace_run
        self.closing_margin = closing_margin
        # The engine batches this row's mask through it (engine.sampling_params.MaskProcessor).
        self.mask_batcher = mask_batcher
        # SQL: binds aliases and table qualifiers to FROM while decoding (sql_scope.py tracks scopes, sql_guard.py filters tokens)
        # JSON Schema and tool calls: keeps every number a finite double (json_numbers.py)
        self.guard_fallbacks = 0  # dead ends: the guard vetoed every token (the sequence ends with an error)
        self.guard = (SQLScopeGuard.from_grammar(compiled.spec.source, tok, max_tokens)  # (new names within the budget)
                      if compiled.spec.kind is ConstraintKind.SQL
                      else FiniteNumberGuard(tok, compiled.spec.json_starts or ())
                      if compiled.spec.kind is ConstraintKind.JSON_SCHEMA
                      else FiniteNumberGuard(tok, compiled.spec.json_starts)
                      if compiled.spec.kind is ConstraintKind.TOOL_CALLS and compiled.spec.json_starts is not None
                      else None)
        self.planner = ClosingPlanner(compiled, max_tokens, closing_margin)
        self._token_bytes = tok.token_bytes
        self._ws_run = 0  # trailing whitespace bytes of the output so far
        self.vocab_size = tok.vocab_size
        self.tok_words = bitmask_words(tok.vocab_size)
        self._scratch: torch.Tensor | None = None
        self._peeked: tuple[int, torch.Tensor] | None = None  # (consumed, [1, tok_words] mask) of forced_token
        self._tiers: tuple[int, list[tuple[int, ...]] | None] | None = None  # (consumed, `_tier_ids`) last found
        self.consumed = 0
        self.ended = False  # an EOS id was consumed
        self.error = ""
        # the sampler's lazy path (first_allowed): steps decided by a candidate, candidates checked,
        # steps that needed the full mask
        self.lazy_hits = self.lazy_checked = self.lazy_fallbacks = 0

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
            if not self._matcher_accepts():
                self.error = f"EOS {token} before the output was complete"
            self.ended = True
            return not self.error
        self.planner.follow(token)
        if not self.matcher.consume(token):
            self.error = self.matcher.error() or f"token {token} not allowed"
            return False
        self.planner.output.append(token)
        if self.guard is not None:
            self.guard.consume(token)
        piece = self._token_bytes[token] if token < len(self._token_bytes) else None
        if piece:
            stripped = piece.rstrip()
            self._ws_run = self._ws_run + len(piece) if not stripped else len(piece) - len(stripped)
        return True

    def _matcher_accepts(self) -> bool:
        return self.matcher.is_accepting() and (self.guard is None or self.guard.allows_end())

    def is_accepting(self) -> bool:
        return not self.error and (self.ended or self._matcher_accepts())

    def is_terminated(self) -> bool:
        return self.ended or bool(self.error) or self.matcher.is_terminated()

    def _closing(self) -> bool:
        return self.max_tokens is not None and self.max_tokens - self.consumed <= self.closing_window

    def _planned_token(self) -> int | None:
        """Next token of the completion path when the budget requires following it now (else None)."""
        return self.planner.next_token(self.matcher.llg, self.guard, self.consumed, self._closing())

    # -- the closing planner's state (closing_planner.py) ----------------------------------------
    @property
    def plan(self) -> list[int] | None:
        """The committed completion path's rest (forced token by token), or None."""
        return self.planner.plan

    # searches run, checks answered by the last path, seconds in searches, checks whose search found no path that fits
    plan_searches = property(lambda self: self.planner.searches)
    plan_reuses = property(lambda self: self.planner.reuses)
    plan_search_s = property(lambda self: self.planner.search_s)
    plan_failures = property(lambda self: self.planner.failures)

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
        eos_row, closer_tiers, ws_row = special_rows(self.compiled.tokenizer, self.eos_ids, words)
        if self.is_terminated():
            out[:] = eos_row
            return
        out[self.tok_words:] = 0
        out &= ~eos_row
        if self.guard is not None:
            self.guard.filter(out)
            if not out.any():  # a dead end the guard could not see ahead of: end here (the output is
                # reported invalid and retried) rather than let unchecked SQL through
                self.guard_fallbacks += 1
                self.error = self.error or "SQL scope guard: no token can bind the names written so far"
                out[:] = eos_row
                return
        if self._ws_run >= self.max_whitespace_run:
            no_ws = out & ~ws_row
            if no_ws.any():
                out[:] = no_ws
        accepting = self._matcher_accepts()
        if not accepting and (forced := self._planned_token()) is not None:
            out[:] = ids_to_row((forced,), words)
            return
        if self._closing():
            if accepting:
                out[:] = eos_row
                return
            if isinstance(self.guard, SQLScopeGuard):
                closer_tiers = sql_closer_rows(self.compiled.tokenizer, self.guard.scope.mode, words)
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

    # -- jump-forward and the logits processor --------------------------------------------------
    def forced_token(self, token_ids: Sequence[int]) -> int | None:
        """The one id the mask allows after `token_ids` (jump-forward: sampling could pick nothing else), or None.
        The mask is kept for the step that samples from it (by the mask batcher, else for `__call__`)."""
        if self.mask_batcher is not None:
            return self.mask_batcher.forced_tokens([(self, token_ids)])[0]
        self.advance(token_ids)
        self._peeked = (self.consumed, torch.empty(1, self.tok_words, dtype=torch.int32))
        self.fill_bitmask(self._peeked[1], 0)
        return only_id(self._peeked[1][0])

    def __call__(self, token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        """Logits-processor form: advance by the new ids, then mask logits [V] in place."""
        self.advance(token_ids)
        words = bitmask_words(logits.shape[-1])
        if self._peeked is not None and self._peeked[0] == self.consumed:  # forced_token computed it
            mask, self._peeked = self._peeked[1], None
            apply_bitmask_(logits.view(1, -1)[:, :mask.shape[1] * 32], mask)
            logits[mask.shape[1] * 32:] = float("-inf")
            return logits
        if self._scratch is None or self._scratch.shape[1] != words:
            self._scratch = torch.empty(1, words, dtype=torch.int32)
        self.fill_bitmask(self._scratch, 0)
        apply_bitmask_(logits.view(1, -1), self._scratch)
        return logits
