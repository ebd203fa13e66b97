"""LRU cache of compiled constraints, keyed by constraint digest + tokenizer hash; bounded compile."""

from __future__ import annotations

import concurrent.futures as cf
import functools
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from .base import CompiledConstraint, ConstraintSpec
from .errors import ConstraintCompileTimeout
from .registry import get_backend
from .vocab import TokenizerInfo


@dataclass(frozen=True)
class CompileConfig:
    timeout_s: float = 10.0
    cache_entries: int = 256

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.cache_entries < 1:
            raise ValueError(f"cache_entries must be >= 1, got {self.cache_entries}")


class ConstraintCache:
    """Thread-safe LRU of CompiledConstraint; failures are not cached (a retry recompiles)."""

    def __init__(self, config: CompileConfig | None = None) -> None:
        self.config = config or CompileConfig()
        self._entries: OrderedDict[tuple[str, str, str], CompiledConstraint] = OrderedDict()
        self._lock = threading.Lock()
        # Compiles run here so a timeout can return to the caller; llguidance drops the GIL.
        self._pool = cf.ThreadPoolExecutor(max_workers=4, thread_name_prefix="constraint-compile")
        self.hits = self.misses = 0
        self.last_compile_s = 0.0

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _key(spec: ConstraintSpec, tokenizer: TokenizerInfo, backend: str | None):
        """(the backend that compiles `spec`, the cache key of its compile: backend, spec digest, tokenizer hash)."""
        impl = get_backend(spec.kind, backend)
        return impl, (impl.name, spec.digest, tokenizer.hash)

    def compiled(
        self, spec: ConstraintSpec, tokenizer: TokenizerInfo, backend: str | None = None
    ) -> CompiledConstraint | None:
        """The cached compile of `spec`, or None; compiles nothing, counts nothing (a caller that must not wait for
        a compile checks first)."""
        _, key = self._key(spec, tokenizer, backend)
        with self._lock:
            return self._entries.get(key)

    def get_or_compile(
        self, spec: ConstraintSpec, tokenizer: TokenizerInfo, backend: str | None = None
    ) -> CompiledConstraint:
        impl, key = self._key(spec, tokenizer, backend)
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                self.hits += 1
                return self._entries[key]
            self.misses += 1
        tokenizer.warm()  # once per tokenizer, outside the compile's time limit
        start = time.perf_counter()
        future = self._pool.submit(impl.compile, spec, tokenizer)
        try:
            compiled = future.result(timeout=self.config.timeout_s)
        except cf.TimeoutError:
            future.cancel()  # a compile already running finishes in its thread and is dropped
            raise ConstraintCompileTimeout(spec.kind, self.config.timeout_s) from None
        self.last_compile_s = time.perf_counter() - start
        with self._lock:
            self._entries[key] = compiled
            self._entries.move_to_end(key)
            while len(self._entries) > self.config.cache_entries:
                self._entries.popitem(last=False)
        return compiled


@functools.cache
def default_cache() -> ConstraintCache:
    """The process-wide constraint cache (LRU of compiled constraints)."""
    return ConstraintCache()
