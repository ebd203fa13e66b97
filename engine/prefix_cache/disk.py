"""Local-disk tier: one file per block hash, atomic writes, verified reads, LRU bounded in bytes; survives restart."""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

import torch

from engine.prefix_cache.base import CacheTier, CorruptEntry, TierStats
from engine.prefix_cache.entry import EntryCodec

log = logging.getLogger(__name__)


class DiskTier(CacheTier):
    name = "disk"

    def __init__(self, root: str | Path, capacity_bytes: int, codec: EntryCodec) -> None:
        # Entries of different fingerprints live in different folders: a new model never scans the old ones.
        self.root = Path(root) / codec.fingerprint[:16]
        self.root.mkdir(parents=True, exist_ok=True)
        self.capacity = capacity_bytes
        self.codec = codec
        self.stats = TierStats()
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> file size, LRU first
        self._load_index()

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.kv"

    def _load_index(self) -> None:
        """Rebuilds the LRU from the files left by a previous run (oldest access first); drops temp files."""
        found = []
        for path in self.root.glob("*/*"):
            if path.suffix != ".kv":
                path.unlink(missing_ok=True)  # a write interrupted by a crash
                continue
            st = path.stat()
            found.append((st.st_mtime, path.stem, st.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self.stats.bytes += size
        self.stats.entries = len(self._index)
        self._evict_over_capacity()

    def get(self, key: str) -> torch.Tensor | None:
        with self._lock:
            if key not in self._index:
                return None
            self._index.move_to_end(key)
        path = self._path(key)
        try:
            data = path.read_bytes()
            kv = self.codec.decode(key, data)
        except CorruptEntry as exc:
            log.warning("disk prefix cache: dropping %s", exc)
            self.stats.corrupt += 1
            self._drop(key)
            return None
        except OSError as exc:
            log.warning("disk prefix cache: cannot read %s: %s", path, exc)
            self.stats.errors += 1
            self._drop(key)
            return None
        try:
            os.utime(path)  # access time for the LRU order after a restart
        except OSError:
            pass
        return kv

    def put(self, key: str, kv: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return []
        data = self.codec.encode(key, kv)
        if len(data) > self.capacity:
            return []
        path = self._path(key)
        path.parent.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{key[:8]}", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("disk prefix cache: cannot write %s: %s", path, exc)
            self.stats.errors += 1
            Path(tmp).unlink(missing_ok=True)
            return []
        with self._lock:
            self._index[key] = len(data)
            self.stats.bytes += len(data)
            self.stats.writes += 1
            self.stats.entries = len(self._index)
            self._evict_over_capacity()
        return []  # disk is the last local tier: what it evicts is gone

    def _evict_over_capacity(self) -> None:
        while self.stats.bytes > self.capacity and self._index:
            key, size = self._index.popitem(last=False)
            self.stats.bytes -= size
            self.stats.evictions += 1
            self._path(key).unlink(missing_ok=True)
        self.stats.entries = len(self._index)

    def _drop(self, key: str) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self.stats.bytes -= size
                self.stats.entries = len(self._index)
        self._path(key).unlink(missing_ok=True)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self._index
