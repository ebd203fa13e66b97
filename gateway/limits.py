"""Admission control: apply a resolved policy's Limits to one request through a Store."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.stores.base import Lease, Store
from policies.model import Limits

DAY_S = 86400


class LimitExceeded(Exception):
    """A policy limit refuses the request. `limit` names it; `retry_after` (seconds) is None when waiting
    cannot help (max_tokens too large: answer 400; otherwise 429 with Retry-After)."""

    def __init__(self, limit: str, message: str, retry_after: float | None):
        super().__init__(message)
        self.limit, self.retry_after = limit, retry_after


@dataclass
class Admission:
    max_tokens: int | None  # the request's effective max_tokens (policy cap when the request gave none)
    lease: Lease | None  # concurrency slot: release when the response is finished (or use `async with`)
    degraded: bool  # some check was skipped because the store was unreachable (fail_open)

    async def release(self) -> None:
        if self.lease is not None:
            await self.lease.release()

    async def __aenter__(self) -> Admission:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.release()


async def admit(store: Store, limits: Limits, tenant_id: str, prompt_tokens: int,
                max_tokens: int | None) -> Admission:
    """Check max_tokens, requests/min, concurrency, tokens/min (charged prompt + max_tokens up front) and the
    daily token budget, in that order. Raises LimitExceeded (or StoreUnavailable when fail_closed)."""
    if max_tokens is not None and limits.max_tokens is not None and max_tokens > limits.max_tokens:
        raise LimitExceeded("max_tokens", f"max_tokens {max_tokens} exceeds the policy limit {limits.max_tokens}",
                            None)
    effective = max_tokens if max_tokens is not None else limits.max_tokens
    degraded = False
    if limits.requests_per_min is not None:
        d = await store.rate_limit(f"{tenant_id}:rpm", limits.requests_per_min / 60.0,
                                   limits.request_burst or limits.requests_per_min)
        degraded |= d.degraded
        if not d.allowed:
            raise LimitExceeded("requests_per_min", f"tenant {tenant_id!r} exceeded "
                                                    f"{limits.requests_per_min} requests/min", d.retry_after)
    lease = None
    if limits.concurrency is not None:
        lease = await store.acquire_concurrency(f"{tenant_id}:conc", limits.concurrency)
        if lease is None:
            raise LimitExceeded("concurrency", f"tenant {tenant_id!r} already has {limits.concurrency} requests "
                                               f"in flight", 1.0)
        degraded |= lease.degraded
    try:
        if limits.tokens_per_min is not None:
            cost = prompt_tokens + (effective or 0)
            d = await store.rate_limit(f"{tenant_id}:tpm", limits.tokens_per_min / 60.0,
                                       limits.token_burst or limits.tokens_per_min, cost)
            degraded |= d.degraded
            if not d.allowed:
                wait = None if d.retry_after == float("inf") else d.retry_after
                raise LimitExceeded("tokens_per_min", f"tenant {tenant_id!r}: {cost} tokens exceed the "
                                                      f"{limits.tokens_per_min} tokens/min allowance", wait)
        if limits.tokens_per_day is not None:
            # zero-amount probe against limit-1: allowed exactly when used < limit
            b = await store.budget_consume(f"{tenant_id}:day", 0, limits.tokens_per_day - 1, DAY_S)
            degraded |= b.degraded
            if not b.allowed:
                raise LimitExceeded("tokens_per_day", f"tenant {tenant_id!r} used its daily budget of "
                                                      f"{limits.tokens_per_day} tokens", b.reset_after)
    except BaseException:
        if lease is not None:
            await lease.release()
        raise
    return Admission(effective, lease, degraded)


async def settle(store: Store, limits: Limits, tenant_id: str, used_tokens: int) -> None:
    """Record the tokens a finished request actually used against the daily budget."""
    if limits.tokens_per_day is not None and used_tokens > 0:
        await store.budget_consume(f"{tenant_id}:day", used_tokens, limits.tokens_per_day, DAY_S, force=True)
