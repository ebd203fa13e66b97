"""Batched masks: fill every constrained row of a [B, W] bitmask at once, optionally while the
forward pass runs (llguidance releases the GIL), then apply them to the [B, V] logits in one op."""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Sequence

import llguidance
import torch

from .bitmask import apply_bitmask_
from .constraint import Constraint


class BatchMasker:
    """Owns an llguidance executor and one background thread for overlapping mask computation."""

    def __init__(self, num_threads: int | None = None) -> None:
        self._executor = llguidance.LLExecutor(num_threads=num_threads)
        self._thread = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="mask-prefetch")

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

    @staticmethod
    def apply(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        """Mask logits [B, V] in place with bitmask [B, ceil(V/32)]."""
        return apply_bitmask_(logits, bitmask)

    def close(self) -> None:
        self._thread.shutdown(wait=True)
