"""Batched masks: fill every constrained row of a [B, W] bitmask at once (llguidance's executor
computes the rows in parallel and releases the GIL), optionally while the forward pass runs, then
apply them to the logits rows.

BatchMasker is the engine's MaskBatcher (engine/sampling_params.py): `masks` joins the rows
prefetched after the previous sample and fills the others in one call; `prefetch` starts the next.
Prefetch pays where the forward pass leaves the CPU idle (a CUDA forward); where the forward itself
runs on every CPU core the mask thread only competes with it (measured slower on 2 cores), so it
is on by default only with CUDA.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
from collections.abc import Sequence

import llguidance
import torch

from .bitmask import apply_bitmask_, only_id
from .constraint import Constraint

# The sampler checks a row's best candidates (one token each: grammar, guard) before filling its full
# mask; a competent model's pick is nearly always among the first few (docs/structured.md).
LAZY_CANDIDATES = 8


class BatchMasker:
    """Owns an llguidance executor and one background thread for overlapping mask computation."""

    def __init__(self, num_threads: int | None = None, prefetch: bool | None = None,
                 lazy_candidates: int = LAZY_CANDIDATES) -> None:
        if lazy_candidates < 0:
            raise ValueError(f"lazy_candidates must be >= 0 (0: every step's full mask), got {lazy_candidates}")
        # candidates the sampler checks one by one before a row's full mask (engine/sampler.py); 0: full masks
        self.lazy_candidates = lazy_candidates
        self._executor = llguidance.LLExecutor(num_threads=num_threads)
        self.prefetching = torch.cuda.is_available() if prefetch is None else prefetch
        self._thread = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="mask-prefetch")
        self._words = 0  # row width of the last `masks` call (the logits' vocabulary, padded)
        # id(constraint) -> (constraint, consumed count, future, bitmask, row) of the last prefetch
        self._pending: dict[int, tuple[Constraint, int, cf.Future, torch.Tensor, int]] = {}
        self.prefetch_hits = 0  # rows served from a prefetch (for tests and metrics)
        # lazy verification over this batcher's constraints (Constraint.first_allowed): steps a candidate
        # decided, candidates checked, steps that needed the full mask
        self.lazy_totals = {"hits": 0, "candidates_checked": 0, "fallbacks": 0}

    def fill(self, constraints: Sequence[Constraint | None], bitmask: torch.Tensor) -> None:
        """bitmask [B, W] int32 CPU: row b gets constraints[b]'s mask, or all ones when None."""
        if len(constraints) != bitmask.shape[0]:
            raise ValueError(f"{len(constraints)} constraints for a bitmask of {bitmask.shape[0]} rows")
        parallel: dict[int, list[tuple[llguidance.LLMatcher, int]]] = {}
        for b, c in enumerate(constraints):
            if c is None:
                bitmask[b].fill_(-1)
            elif c.matcher.llg is not None and not c.is_terminated():
                parallel.setdefault(c.tok_words, []).append((c.matcher.llg, b))
            else:
                c.fill_bitmask(bitmask, b)
        for tok_words, items in parallel.items():
            if len(items) == 1:  # one row: a direct call beats the executor's thread hand-off (~100 us)
                constraints[items[0][1]].fill_bitmask(bitmask, items[0][1])
                continue
            if tok_words == bitmask.shape[1]:
                target = bitmask
            else:  # logits are padded past the vocabulary: llguidance wants exact-size rows
                target = torch.empty(bitmask.shape[0], tok_words, dtype=torch.int32)
            self._executor.unsafe_compute_mask_ptr(items, target.data_ptr(), tok_words * 4, target.shape[0])
            if target is not bitmask:
                rows = torch.tensor([b for _, b in items])
                bitmask[rows, :tok_words] = target[rows]
            for _, b in items:
                constraints[b].finish_row(bitmask, b)

    def fill_async(self, constraints: Sequence[Constraint | None], bitmask: torch.Tensor) -> cf.Future:
        """Start `fill` in the background (call after advancing the constraints, before the forward)."""
        return self._thread.submit(self.fill, list(constraints), bitmask)

    def masks(self, constraints: Sequence[Constraint], words: int) -> torch.Tensor:
        """[n, words] int32 bitmask of the (already advanced) constraints: prefetched rows whose
        constraint has not moved since, the others filled now in one batched call."""
        self._words = words
        for _, _, future, _, _ in self._pending.values():
            future.result()  # join every prefetch (re-raises a failed one) before touching any state
        out = torch.empty(len(constraints), words, dtype=torch.int32)
        missing = []
        for i, c in enumerate(constraints):
            pre = self._pending.pop(id(c), None)
            if pre is not None:
                owner, consumed, future, bitmask, row = pre
                if owner is c and consumed == c.consumed and bitmask.shape[1] == words:
                    out[i] = bitmask[row]
                    self.prefetch_hits += 1
                    continue
            missing.append(i)
        if missing:
            rows = torch.empty(len(missing), words, dtype=torch.int32)
            self.fill([constraints[i] for i in missing], rows)
            out[missing] = rows
        return out

    def wait(self) -> None:
        """Join the prefetches in flight (a constraint must not be touched while its mask computes)."""
        for _, _, future, _, _ in self._pending.values():
            future.result()

    def forced_tokens(self, items: Sequence[tuple[Constraint, Sequence[int]]]) -> list[int | None]:
        """Constraint.forced_token for many sequences at once ((constraint, its generated ids) each): the masks
        not already current are filled in one batched call and kept for the step that samples from them.
        With `lazy_candidates`, only the masks of constraints that may force a token (Constraint.may_force:
        the grammar forces bytes, a completion plan, ...): the others report None without a mask (their next
        token is sampled: the same token, jump-forward only saves a step); and where the row is known without its
        mask (`_forced_known`), its answer."""
        self.wait()  # no prefetch reads these constraints, nor uses the executor beside this fill
        for constraint, token_ids in items:
            constraint.advance(token_ids)
        forcing = [not self.lazy_candidates or c.may_force() for c, _ in items]
        known = [_forced_known(c) if f and self.lazy_candidates else None
                 for (c, _), f in zip(items, forcing, strict=True)]
        forcing = [f and k is None for f, k in zip(forcing, known, strict=True)]
        # the last `masks` call's width, unless these constraints need wider rows (the process-wide masker serves
        # every engine of the process: that call may have been another model's, of a smaller vocabulary)
        words = max(self._words, *(c.tok_words for c, _ in items))
        stale = [c for (c, _), f in zip(items, forcing, strict=True) if f and not self._current(c, words)]
        if stale:
            self._keep(stale, words)
        rows = [self._pending[id(c)] if f else None for (c, _), f in zip(items, forcing, strict=True)]
        return [k[0] if k is not None else only_id(r[3][r[4]]) if r is not None else None
                for r, k in zip(rows, known, strict=True)]

    def _current(self, constraint: Constraint, words: int) -> bool:
        """Whether the kept mask of `constraint` is its current state's (at this row width)."""
        pre = self._pending.get(id(constraint))
        return (pre is not None and pre[0] is constraint and pre[1] == constraint.consumed
                and pre[3].shape[1] == words)

    def _keep(self, constraints: Sequence[Constraint], words: int) -> None:
        """Fill the constraints' current masks now (one batched call) and keep them as finished prefetches."""
        bitmask = torch.empty(len(constraints), words, dtype=torch.int32)
        self.fill(constraints, bitmask)
        done: cf.Future = cf.Future()
        done.set_result(None)
        for row, c in enumerate(constraints):
            self._pending[id(c)] = (c, c.consumed, done, bitmask, row)

    def prefetch(self, constraints: Sequence[Constraint]) -> None:
        """Start filling the masks of the next step for `constraints` (just advanced by their new
        token) in the background thread; the previous step's unused prefetches are dropped."""
        for _, _, future, _, _ in self._pending.values():
            future.result()
        self._pending.clear()
        if not self.prefetching or not self._words or not constraints:
            return
        bitmask = torch.empty(len(constraints), self._words, dtype=torch.int32)
        future = self.fill_async(constraints, bitmask)
        for row, c in enumerate(constraints):
            self._pending[id(c)] = (c, c.consumed, future, bitmask, row)

    @staticmethod
    def apply(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        """Mask logits [B, V] in place with bitmask [B, ceil(V/32)]."""
        return apply_bitmask_(logits, bitmask)

    def close(self) -> None:
        self._pending.clear()
        self._thread.shutdown(wait=True)


def _forced_known(c: Constraint) -> tuple[int | None] | None:
    """(the id the row allows alone, or None where it allows several) where the constraint knows its row without
    the mask: the grammar forces a whole token that every other rule leaves (`forced_by_grammar`), or its rules
    leave a few known ids (`known_row`: a completion plan's token, the closing window's closers, EOS); None where
    the mask must tell."""
    if (token := c.forced_by_grammar()) is not None:
        return (token,)
    row = c.known_row()
    return None if row is None else (row[0] if len(set(row)) == 1 else None,)


@functools.cache
def default_masker() -> BatchMasker:
    """The process-wide BatchMasker the gateway attaches to each whole-request Constraint."""
    return BatchMasker()
