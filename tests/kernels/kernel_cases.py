"""Small random expert weights and routings shared by the kernel tests."""

from __future__ import annotations

import contextlib

import torch

from kernels.fused_moe import kernel_library


def random_experts(e: int, h: int, i: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """w_gate_up [E, 2I, H], w_down [E, H, I] with a few outlier weights (exercise group scales)."""
    g = torch.Generator().manual_seed(seed)
    w_gu = torch.randn(e, 2 * i, h, generator=g) * 0.05
    w_dn = torch.randn(e, h, i, generator=g) * 0.05
    w_gu[:, 0, 0] = 0.4
    w_dn[:, -1, -1] = -0.3
    return w_gu, w_dn


def random_routing(t: int, k: int, e: int, seed: int = 0, skip_frac: float = 0.0):
    """topk_ids [T, k] (distinct per row, some -1 if skip_frac) and topk_weights [T, k]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    if skip_frac:
        ids[torch.rand(t, k, generator=g) < skip_frac] = -1
    return ids, torch.softmax(torch.randn(t, k, generator=g), dim=-1)


@contextlib.contextmanager
def exact_threads(variant: str | None = None):
    """The kernel pool's sizing off (kernels/csrc/work_pool.h): each job runs on the threads it asks for, however
    small and however busy the machine, so a test comparing thread counts runs them."""
    lib = kernel_library(variant)
    old = lib.moegate_pool_sizing(0) if lib is not None else None
    try:
        yield
    finally:
        if old is not None:
            lib.moegate_pool_sizing(old)
