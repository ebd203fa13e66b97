"""Decode one constrained output with any logits source (seeded random logits, or a real model)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from gateway.structured.constraint import Constraint

# A model step: the ids generated so far -> next-token logits [V]. A real engine plugs in here.
LogitsFn = Callable[[list[int]], torch.Tensor]


def random_logits(vocab: int, seed: int) -> LogitsFn:
    """A 'random-weight model': i.i.d. Gaussian logits, reproducible from the seed."""
    gen = torch.Generator().manual_seed(seed)
    return lambda ids: torch.randn(vocab, generator=gen)


@dataclass
class Decoded:
    ids: list[int]
    finished: bool  # the constraint accepted and EOS was emitted
    mask_s: list[float] = field(default_factory=list)  # per step: advance + fill + apply


def decode(constraint: Constraint, logits_fn: LogitsFn, max_tokens: int) -> Decoded:
    """Greedy decode under the constraint until EOS or max_tokens."""
    ids: list[int] = []
    out = Decoded(ids, False)
    for _ in range(max_tokens):
        logits = logits_fn(ids)
        t0 = time.perf_counter()
        constraint(ids, logits)
        out.mask_s.append(time.perf_counter() - t0)
        token = int(torch.argmax(logits))
        ids.append(token)
        if token in constraint.eos_ids:
            constraint.advance(ids)
            out.finished = constraint.is_accepting()
            break
    return out
