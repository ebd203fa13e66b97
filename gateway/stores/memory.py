"""In-memory store (the embedded default): one process, one event loop, no external service."""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from gateway.stores.base import (
    BudgetDecision,
    Decision,
    IdempotencyBegin,
    IdempotencyKeyMismatch,
    IdemState,
    Lease,
    Store,
    StoredResponse,
)


@dataclass
class _IdemEntry:
    fingerprint: str
    token: str | None
    expires_at: float
    response: StoredResponse | None = None


class MemoryStore(Store):
    """Everything in dicts. Methods never await inside a read-modify-write, so each is atomic on the loop.
    `clock` (monotonic seconds) and `wall` (epoch seconds, for budget windows) are injectable for tests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):
        self._clock, self._wall = clock, wall
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, last refill time)
        self._leases: dict[str, dict[str, float]] = {}  # key -> token -> expiry
        self._budgets: dict[str, tuple[int, int]] = {}  # key -> (window index, used)
        self._idem: dict[str, _IdemEntry] = {}
        self._idem_events: dict[str, asyncio.Event] = {}
        self._ops = 0

    async def rate_limit(self, key: str, rate: float, burst: float, cost: float = 1.0) -> Decision:
        now = self._clock()
        tokens, ts = self._buckets.get(key, (burst, now))
        tokens = min(burst, tokens + max(0.0, now - ts) * rate)
        if tokens >= cost:
            self._buckets[key] = (tokens - cost, now)
            return Decision(True, 0.0, tokens - cost)
        self._buckets[key] = (tokens, now)
        retry = math.inf if cost > burst else (cost - tokens) / rate
        return Decision(False, retry, tokens)

    async def acquire_concurrency(self, key: str, limit: int, ttl_s: float = 300.0) -> Lease | None:
        now = self._clock()
        held = {t: exp for t, exp in self._leases.get(key, {}).items() if exp > now}
        self._leases[key] = held
        if len(held) >= limit:
            return None
        token = secrets.token_hex(8)
        held[token] = now + ttl_s

        async def release() -> None:
            self._leases.get(key, {}).pop(token, None)

        async def renew(ttl: float) -> bool:
            slots = self._leases.get(key, {})
            if slots.get(token, 0.0) <= self._clock():
                slots.pop(token, None)
                return False
            slots[token] = self._clock() + ttl
            return True

        return Lease(release, renew)

    async def budget_consume(self, key: str, amount: int, limit: int, window_s: int,
                             *, force: bool = False) -> BudgetDecision:
        now = self._wall()
        window = int(now // window_s)
        reset_after = (window + 1) * window_s - now
        idx, used = self._budgets.get(key, (window, 0))
        if idx != window:
            used = 0
        if used + amount > limit and not force:
            self._budgets[key] = (window, used)
            return BudgetDecision(False, used, limit, reset_after)
        used += amount
        self._budgets[key] = (window, used)
        return BudgetDecision(used <= limit, used, limit, reset_after)

    def _sweep(self) -> None:
        self._ops += 1
        if self._ops % 1024 == 0:
            now = self._clock()
            for k in [k for k, e in self._idem.items() if e.expires_at <= now]:
                del self._idem[k]

    async def _idem_try(self, key: str, fingerprint: str, lock_ttl_s: float) -> IdempotencyBegin:
        self._sweep()
        now = self._clock()
        entry = self._idem.get(key)
        if entry is None or entry.expires_at <= now:
            token = secrets.token_hex(16)
            self._idem[key] = _IdemEntry(fingerprint, token, now + lock_ttl_s)
            return IdempotencyBegin(IdemState.NEW, token=token)
        if entry.fingerprint != fingerprint:
            raise IdempotencyKeyMismatch(f"Idempotency-Key {key!r} was already used with a different request")
        if entry.response is not None:
            return IdempotencyBegin(IdemState.COMPLETED, response=entry.response)
        return IdempotencyBegin(IdemState.IN_PROGRESS)

    async def _idem_wait(self, key: str, timeout_s: float) -> None:
        entry = self._idem.get(key)
        # the owner's lock may expire without anyone calling us: never sleep past it
        timeout_s = min(timeout_s, max(0.0, entry.expires_at - self._clock()) + 0.001) if entry else 0.0
        event = self._idem_events.setdefault(key, asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except TimeoutError:
            pass

    def _notify(self, key: str) -> None:
        event = self._idem_events.pop(key, None)
        if event is not None:
            event.set()

    async def idempotency_complete(self, key: str, token: str | None, response: StoredResponse,
                                   ttl_s: float = 86400.0) -> bool:
        entry = self._idem.get(key)
        if entry is None or token is None or entry.token != token or entry.response is not None:
            return False
        entry.response, entry.expires_at = response, self._clock() + ttl_s
        self._notify(key)
        return True

    async def idempotency_abandon(self, key: str, token: str | None) -> None:
        entry = self._idem.get(key)
        if entry is not None and token is not None and entry.token == token and entry.response is None:
            del self._idem[key]
            self._notify(key)
