"""Redis tier shared by replicas, written through: verified entries with a TTL. A failed, timed-out or skipped
call is a miss (or a write not made), never an error; a circuit breaker stops calling a hung redis."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import torch

from engine.circuit_breaker import CircuitBreaker
from engine.prefix_cache.base import CacheTier, CorruptEntry, TierStats
from engine.prefix_cache.entry import EntryCodec

log = logging.getLogger(__name__)
T = TypeVar("T")


class RedisTier(CacheTier):
    name = "redis"
    write_through = True  # another replica should see a block as soon as it is computed

    def __init__(self, url: str, codec: EntryCodec, ttl_s: int = 24 * 3600, timeout_s: float = 0.5,
                 breaker: CircuitBreaker | None = None) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # one immediate retry on a broken connection (redis restarted); a timeout is not retried
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                           retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)))
        self.url = url
        self.codec = codec
        self.ttl_s = ttl_s
        self.prefix = f"moegate:kv:{codec.fingerprint[:16]}:"
        self.stats = TierStats()
        self.breaker = breaker or CircuitBreaker()
        self._errors = (redis.RedisError, OSError)

    def _call(self, what: str, fn: Callable[[], T], default: T) -> T:
        if not self.breaker.allow():
            self.stats.skipped += 1
            return default
        try:
            result = fn()
        except self._errors as exc:
            self.stats.errors += 1
            log.warning("redis prefix cache: %s failed: %s", what, exc)
            if self.breaker.failure():
                log.warning("redis prefix cache %s: circuit open after %d consecutive failures; not called for "
                            "%.1f s, then one probe", self.url, self.breaker.threshold, self.breaker.cooldown_s)
            return default
        if self.breaker.success():
            log.warning("redis prefix cache %s: reachable again", self.url)
        return result

    def get(self, key: str) -> torch.Tensor | None:
        data = self._call("get", lambda: self.client.get(self.prefix + key), None)
        if data is None:
            return None
        try:
            return self.codec.decode(key, data)
        except CorruptEntry as exc:
            log.warning("redis prefix cache: dropping %s", exc)
            self.stats.corrupt += 1
            self._call("delete", lambda: self.client.delete(self.prefix + key), 0)
            return None

    def put(self, key: str, kv: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        def write() -> int:  # encoded only when the call is made
            data = self.codec.encode(key, kv)
            return len(data) if self.client.set(self.prefix + key, data, ex=self.ttl_s, nx=True) else 0

        written = self._call("set", write, 0)
        if written:
            self.stats.bytes += written
            self.stats.writes += 1
            self.stats.entries += 1
        return []

    def __contains__(self, key: str) -> bool:
        return bool(self._call("exists", lambda: self.client.exists(self.prefix + key), 0))

    def close(self) -> None:
        self.client.close()
