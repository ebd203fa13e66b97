"""Redis tier shared by replicas: verified entries with a TTL; a connection failure is a miss, never an error."""

from __future__ import annotations

import logging

import torch

from engine.prefix_cache.base import CacheTier, CorruptEntry, TierStats
from engine.prefix_cache.entry import EntryCodec

log = logging.getLogger(__name__)


class RedisTier(CacheTier):
    name = "redis"

    def __init__(self, url: str, codec: EntryCodec, ttl_s: int = 24 * 3600, timeout_s: float = 0.5) -> None:
        import redis

        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.codec = codec
        self.ttl_s = ttl_s
        self.prefix = f"moegate:kv:{codec.fingerprint[:16]}:"
        self.stats = TierStats()
        self._errors = (redis.RedisError, OSError)

    def get(self, key: str) -> torch.Tensor | None:
        try:
            data = self.client.get(self.prefix + key)
        except self._errors as exc:
            log.warning("redis prefix cache: get failed: %s", exc)
            self.stats.errors += 1
            return None
        if data is None:
            return None
        try:
            return self.codec.decode(key, data)
        except CorruptEntry as exc:
            log.warning("redis prefix cache: dropping %s", exc)
            self.stats.corrupt += 1
            try:
                self.client.delete(self.prefix + key)
            except self._errors:
                self.stats.errors += 1
            return None

    def put(self, key: str, kv: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        data = self.codec.encode(key, kv)
        try:
            if self.client.set(self.prefix + key, data, ex=self.ttl_s, nx=True):
                self.stats.bytes += len(data)
                self.stats.writes += 1
                self.stats.entries += 1
        except self._errors as exc:
            log.warning("redis prefix cache: set failed: %s", exc)
            self.stats.errors += 1
        return []

    def __contains__(self, key: str) -> bool:
        try:
            return bool(self.client.exists(self.prefix + key))
        except self._errors:
            self.stats.errors += 1
            return False

    def close(self) -> None:
        self.client.close()
