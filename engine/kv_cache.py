"""Paged KV cache: fixed-size blocks in one pool per layer, and the block manager that hands them out."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
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
        tensors, heads, width = cfg.kv_cache_layout
        per_token = tensors * len(cfg.kv_layers) * heads * width * torch.finfo(dtype).bits // 8
        return per_token * block_size

    @classmethod
    def from_budget(cls, cfg: ModelConfig, gib: float, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        per_block = cls.bytes_per_block(cfg, block_size, dtype)
        return cls(num_blocks=max(1, int(gib * 2**30) // per_block), block_size=block_size)


def allocate_kv_cache(
    cfg: ModelConfig, spec: KVCacheSpec, dtype: torch.dtype, device: torch.device | str
) -> list[tuple[torch.Tensor, ...]]:
    """The cache tensors of each layer with KV (`cfg.kv_layers`: not linear-attention ones), each
    [num_blocks * block_size, heads, width] (`cfg.kv_cache_layout`): (K, V) per KV head, or MLA's one latent."""
    tensors, heads, width = cfg.kv_cache_layout
    shape = (spec.num_blocks * spec.block_size, heads, width)
    return [tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(tensors))
            for _ in cfg.kv_layers]


class OutOfBlocks(Exception):
    """The pool cannot cover the request; the scheduler preempts or waits."""


class BlockManager:
    """Allocator of KV blocks with reference counts (shared prefix blocks count > 1) and the device cache tier.

    A full block whose KV is computed may be registered under its prefix hash. When its last reference
    goes, a registered block stays "cached free": allocatable, but reusable by hash until a new allocation
    takes it (LRU), at which point `on_evict(block, hash)` runs first so its KV can be demoted.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._offsets = torch.arange(block_size)  # slot offsets inside a block (`slots`)
        # id(block table) -> (its blocks when computed, their slots [blocks * bs]): a decode step slices them
        self._slot_rows: dict[int, tuple[list[int], torch.Tensor]] = {}
        self._free: deque[int] = deque(range(num_blocks))  # blocks holding nothing worth keeping
        self._cached: OrderedDict[int, None] = OrderedDict()  # unreferenced registered blocks, LRU first
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, str] = {}
        self._block_of: dict[str, int] = {}
        self.on_evict: Callable[[int, str], None] | None = None
        self.evictions = 0
        self.frees = 0  # tables freed so far: a table only grows in between, so slots read from it stay its slots

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take (plain free plus cached free)."""
        return len(self._free) + len(self._cached)

    @property
    def num_cached_free(self) -> int:
        return len(self._cached)

    @property
    def num_hashed(self) -> int:
        return len(self._hash_of)

    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def blocks_needed(self, block_table: list[int], num_tokens: int) -> int:
        """Extra blocks a sequence with `block_table` needs to hold `num_tokens` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(block_table))

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self) -> int:
        """One block with a single reference; takes a plain free block first, else evicts the LRU cached one."""
        if self._free:
            block = self._free.popleft()
        elif self._cached:
            block, _ = self._cached.popitem(last=False)
            key = self._hash_of.pop(block)
            del self._block_of[key]
            self.evictions += 1
            if self.on_evict is not None:
                self.on_evict(block, key)
        else:
            raise OutOfBlocks("no free KV block")
        self._refs[block] = 1
        return block

    def grow(self, block_table: list[int], num_tokens: int) -> None:
        """Appends blocks to `block_table` in place until it covers `num_tokens`."""
        n = self.blocks_needed(block_table, num_tokens)
        if n > self.num_free:
            raise OutOfBlocks(f"need {n} blocks, {self.num_free} free")
        for _ in range(n):
            block_table.append(self.allocate())

    def share(self, block: int) -> None:
        """Adds a reference to a block already in use (prefix sharing)."""
        if self._refs[block] < 1:
            raise ValueError(f"block {block} is not allocated")
        self._refs[block] += 1

    def free(self, block_table: list[int]) -> None:
        """Drops one reference to each block, returning unreferenced ones to the pool; clears the table.

        The table is released tail first, so a chain's later blocks are evicted before its head.
        """
        for block in reversed(block_table):
            if self._refs[block] < 1:
                raise ValueError(f"double free of block {block}")
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._cached[block] = None
                else:
                    self._free.append(block)
        block_table.clear()
        self._slot_rows.pop(id(block_table), None)
        self.frees += 1

    # -- device cache tier ---------------------------------------------------------------------
    def register(self, block: int, key: str) -> bool:
        """Names an allocated, fully computed block by its prefix hash; False if the hash is already held."""
        if self._refs[block] < 1:
            raise ValueError(f"block {block} is not allocated")
        if key in self._block_of or block in self._hash_of:
            return False
        self._hash_of[block] = key
        self._block_of[key] = block
        return True

    def lookup(self, key: str) -> int | None:
        return self._block_of.get(key)

    def acquire(self, block: int) -> None:
        """Takes a reference to a registered block found by `lookup` (in use or cached free)."""
        if self._refs[block] == 0:
            del self._cached[block]
        self._refs[block] += 1

    def hashed_blocks(self) -> list[tuple[int, str]]:
        return list(self._hash_of.items())

    def forget_cached(self) -> list[tuple[int, str]]:
        """Unregisters every cached-free block (LRU first), returning them to the plain free list."""
        out = []
        while self._cached:
            block, _ = self._cached.popitem(last=False)
            key = self._hash_of.pop(block)
            del self._block_of[key]
            self._free.append(block)
            out.append((block, key))
        return out

    def slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """KV slot ids of token positions [start, end) of a sequence. [end - start] int64, a read-only view:
        the table's slots are kept (checked against its blocks each call) until it grows or is freed."""
        bs = self.block_size
        if end <= start:
            return torch.empty(0, dtype=torch.long)
        n = (end - 1) // bs + 1  # blocks spanned from the first
        kept = self._slot_rows.get(id(block_table))
        if kept is None or len(kept[0]) < n or kept[0][:n] != block_table[:n]:
            if len(self._slot_rows) >= 4 * self.num_blocks:  # tables dropped without `free`
                self._slot_rows.clear()
            blocks = list(block_table)
            table = torch.tensor(blocks, dtype=torch.long)  # [blocks]
            kept = self._slot_rows[id(block_table)] = (blocks, (table[:, None] * bs + self._offsets).view(-1))
        return kept[1][start:end]
