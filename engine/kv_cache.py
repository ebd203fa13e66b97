"""Paged KV cache: fixed-size blocks in one pool per layer, and the block manager that hands them out."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from engine.config import ModelConfig


@dataclass(frozen=True)
class KVCacheSpec:
    num_blocks: int
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.num_blocks < 1 or self.block_size < 1:
            raise ValueError(f"KV cache needs num_blocks >= 1 and block_size >= 1, got {self}")

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8
        return per_token * block_size

    @classmethod
    def from_budget(cls, cfg: ModelConfig, gib: float, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        per_block = cls.bytes_per_block(cfg, block_size, dtype)
        return cls(num_blocks=max(1, int(gib * 2**30) // per_block), block_size=block_size)


def allocate_kv_cache(
    cfg: ModelConfig, spec: KVCacheSpec, dtype: torch.dtype, device: torch.device | str
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (K, V) pair per layer, each [num_blocks * block_size, KV heads, head_dim]."""
    shape = (spec.num_blocks * spec.block_size, cfg.num_kv_heads, cfg.head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(cfg.num_layers)
    ]


class OutOfBlocks(Exception):
    """The pool cannot cover the request; the scheduler preempts or waits."""


class BlockManager:
    """Free-list allocator of KV blocks with reference counts (shared prefix blocks count > 1)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_needed(self, block_table: list[int], num_tokens: int) -> int:
        """Extra blocks a sequence with `block_table` needs to hold `num_tokens` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(block_table))

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Appends blocks to `block_table` in place until it covers `num_tokens`."""
        n = self.blocks_needed(block_table, num_tokens)
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} blocks, {len(self._free)} free")
        for _ in range(n):
            block = self._free.popleft()
            self._refs[block] = 1
            block_table.append(block)

    def share(self, block: int) -> None:
        """Adds a reference to a block already in use (prefix sharing)."""
        if self._refs[block] < 1:
            raise ValueError(f"block {block} is not allocated")
        self._refs[block] += 1

    def free(self, block_table: list[int]) -> None:
        """Drops one reference to each block, returning unreferenced ones to the pool; clears the table."""
        for block in reversed(block_table):
            if self._refs[block] < 1:
                raise ValueError(f"double free of block {block}")
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free.append(block)
        block_table.clear()

    def slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """KV slot ids of token positions [start, end) of a sequence. [end - start] int64"""
        pos = torch.arange(start, end)
        table = torch.tensor(block_table, dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size
