"""Background writes to a cache tier: blocks are encoded and written by a thread, off the request's critical
path; what exceeds the bounded queue is dropped and counted (the writer's and the tier's `dropped`)."""

from __future__ import annotations

import logging
import queue
import threading

import torch

from engine.prefix_cache.base import CacheTier

log = logging.getLogger(__name__)


class BackgroundWriter:
    def __init__(self, max_pending_bytes: int = 256 * 2**20) -> None:
        self._queue: queue.Queue[tuple[CacheTier, str, torch.Tensor] | None] = queue.Queue()
        self.max_pending_bytes = max_pending_bytes
        self.pending_bytes = 0
        self.dropped = 0  # writes skipped because too much was pending (the cache is best effort)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="prefix-cache-writer", daemon=True)
        self._thread.start()

    def submit(self, tier: CacheTier, key: str, kv: torch.Tensor) -> None:
        size = kv.numel() * kv.element_size()
        with self._lock:
            if self.pending_bytes + size > self.max_pending_bytes:
                self.dropped += 1
                tier.stats.dropped += 1
                return
            self.pending_bytes += size
        self._queue.put((tier, key, kv))

    def flush(self) -> None:
        """Blocks until every submitted write is done."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                tier, key, kv = job
                try:
                    tier.put(key, kv)
                finally:
                    with self._lock:
                        self.pending_bytes -= kv.numel() * kv.element_size()
            except Exception:  # a failed write must not kill the writer: the entry is simply not cached
                log.exception("prefix cache write-back failed")
            finally:
                self._queue.task_done()
