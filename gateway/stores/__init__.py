"""Stores for limits, budgets and idempotency: in-memory by default, redis when `REDIS_URL` is set."""

from __future__ import annotations

import os

from gateway.stores.base import (
    BudgetDecision,
    Decision,
    IdempotencyBegin,
    IdempotencyKeyMismatch,
    IdemState,
    Lease,
    OnUnavailable,
    Store,
    StoredResponse,
    StoreUnavailable,
    request_fingerprint,
)
from gateway.stores.memory import MemoryStore


def make_store(redis_url: str | None = None, on_unavailable: OnUnavailable = "fail_closed", *,
               timeout_s: float = 0.5, circuit_failures: int = 3, circuit_cooldown_s: float = 5.0) -> Store:
    """RedisStore for `redis_url` (or `$REDIS_URL` when None is given and it is set), else MemoryStore.
    Each redis call times out after `timeout_s`; `circuit_failures` in a row open the circuit breaker for
    `circuit_cooldown_s`."""
    url = redis_url if redis_url is not None else os.environ.get("REDIS_URL") or None
    if url:
        from engine.circuit_breaker import CircuitBreaker
        from gateway.stores.redis_store import RedisStore

        return RedisStore(url, on_unavailable, timeout_s=timeout_s,
                          breaker=CircuitBreaker(circuit_failures, circuit_cooldown_s))
    return MemoryStore()


__all__ = [
    "BudgetDecision", "Decision", "IdemState", "IdempotencyBegin", "IdempotencyKeyMismatch", "Lease",
    "MemoryStore", "OnUnavailable", "Store", "StoreUnavailable", "StoredResponse", "make_store",
    "request_fingerprint",
]
