"""The cache tier interface below the device pool, its statistics, and the corrupt-entry error."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass

import torch


class CorruptEntry(Exception):
    """A stored entry failed verification (magic, header, shape, checksum); it is dropped, never served."""


@dataclass
class TierStats:
    hits: int = 0  # blocks served
    misses: int = 0  # blocks looked up and not found (or found corrupt)
    bytes: int = 0  # bytes held now (redis: bytes written by this replica)
    entries: int = 0
    evictions: int = 0
    writes: int = 0
    corrupt: int = 0  # entries dropped by verification
    errors: int = 0  # I/O or connection failures (counted, treated as misses)
    skipped: int = 0  # calls not made while the tier's circuit breaker was open (misses, writes not made)
    dropped: int = 0  # writes dropped because the tier's write queue was full (the cache is best effort)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class CacheTier(ABC):
    """One tier of block KV, keyed by block hash (hex). Values are CPU tensors [L, 2, block, KV heads, D].

    `get` returns None on a miss and never returns a bad entry. `put` may evict; it returns the
    (key, tensor) pairs evicted so the manager can demote them further. Tiers are thread-safe: the
    engine thread reads while the background writer writes.
    """

    name: str
    stats: TierStats
    write_through: bool = False  # written when a block is computed (shared tiers), not only when demoted

    @abstractmethod
    def get(self, key: str) -> torch.Tensor | None: ...

    @abstractmethod
    def put(self, key: str, kv: torch.Tensor) -> list[tuple[str, torch.Tensor]]: ...

    @abstractmethod
    def __contains__(self, key: str) -> bool: ...

    def close(self) -> None:  # noqa: B027 - optional hook
        pass
