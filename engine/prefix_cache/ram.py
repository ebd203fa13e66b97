"""Host-RAM tier: an LRU of CPU tensors bounded in bytes."""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from engine.prefix_cache.base import CacheTier, TierStats


class RamTier(CacheTier):
    name = "ram"

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self.stats = TierStats()
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()  # LRU first
        self._lock = threading.Lock()

    def get(self, key: str) -> torch.Tensor | None:
        with self._lock:
            kv = self._entries.get(key)
            if kv is not None:
                self._entries.move_to_end(key)
            return kv

    def put(self, key: str, kv: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        size = kv.numel() * kv.element_size()
        if size > self.capacity:
            return [(key, kv)]  # does not fit at all: passes straight down
        evicted = []
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return []
            self._entries[key] = kv
            self.stats.bytes += size
            self.stats.writes += 1
            while self.stats.bytes > self.capacity:
                old_key, old = self._entries.popitem(last=False)
                self.stats.bytes -= old.numel() * old.element_size()
                self.stats.evictions += 1
                evicted.append((old_key, old))
            self.stats.entries = len(self._entries)
        return evicted

    def pop_all(self) -> list[tuple[str, torch.Tensor]]:
        """Empties the tier (LRU first) so the caller can demote everything."""
        with self._lock:
            items = list(self._entries.items())
            self._entries.clear()
            self.stats.bytes = self.stats.entries = 0
            return items

    def items(self) -> list[tuple[str, torch.Tensor]]:
        with self._lock:
            return list(self._entries.items())

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._entries
