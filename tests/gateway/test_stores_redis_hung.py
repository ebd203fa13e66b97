"""A hung redis (SIGSTOP: connections accepted, nothing answered) degrades to the policy's fail_open /
fail_closed behaviour: socket timeouts bound each call, and after `threshold` of them the circuit breaker
stops calling redis until a probe after the cool-down succeeds."""

from __future__ import annotations

import asyncio

import pytest

from engine.circuit_breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from gateway.stores import StoreUnavailable
from gateway.stores.redis_store import RedisStore

pytestmark = pytest.mark.redis


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_breaker_states():
    clock = Clock()
    b = CircuitBreaker(threshold=2, cooldown_s=5, clock=clock)
    assert b.allow() and not b.failure() and b.state == CLOSED
    b.success()  # a success resets the consecutive count
    assert not b.failure() and b.failure() and b.state == OPEN and b.opened == 1
    assert not b.allow() and b.skipped == 1 and b.retry_in() == 5
    clock.now += 5
    assert b.allow() and b.state == HALF_OPEN  # one probe ...
    assert not b.allow()  # ... the others keep skipping
    assert not b.failure() and b.state == OPEN and b.opened == 1  # the probe failed: open again
    assert not b.allow()
    clock.now += 5
    assert b.allow()
    clock.now += 5  # that probe never reported (cancelled): another may go
    assert b.allow()
    assert b.success() and b.state == CLOSED and b.allow()
    with pytest.raises(ValueError):
        CircuitBreaker(threshold=0)


def test_hung_redis_fails_open_then_closes_on_a_good_probe(redis_server):
    clock = Clock()

    async def main():
        store = RedisStore(redis_server.url, "fail_open", timeout_s=0.2,
                           breaker=CircuitBreaker(threshold=3, cooldown_s=5, clock=clock))
        assert not (await store.rate_limit("k", rate=0.001, burst=1)).degraded
        assert not (await store.rate_limit("k", rate=0.001, burst=1)).allowed  # enforced while up
        redis_server.pause()
        try:
            decisions = [await store.rate_limit("k", rate=0.001, burst=1) for _ in range(40)]
            lease = await store.acquire_concurrency("c", limit=1)
            assert all(d.allowed and d.degraded for d in decisions) and lease.degraded
            await lease.release()
            b = store.breaker
            assert b.state == OPEN and b.opened == 1
            assert b.skipped == 41 - 3  # redis was called `threshold` times, then skipped
            assert not await store.ping() and b.skipped == 39

            clock.now += 5  # cool-down over: one probe, still hung, open again
            assert (await store.rate_limit("k", rate=0.001, burst=1)).degraded
            assert b.state == OPEN and b.skipped == 39
        finally:
            redis_server.resume()
        assert (await store.rate_limit("k", rate=0.001, burst=1)).degraded  # still within the cool-down
        clock.now += 5
        probe = await store.rate_limit("k", rate=0.001, burst=1)
        assert not probe.degraded and not probe.allowed and b.state == CLOSED  # enforcing again
        assert store.available
        await store.close()

    asyncio.run(main())


def test_hung_redis_fails_closed_with_a_clear_error(redis_server):
    async def main():
        store = RedisStore(redis_server.url, "fail_closed", timeout_s=0.2,
                           breaker=CircuitBreaker(threshold=2, cooldown_s=60))
        redis_server.pause()
        try:
            for _ in range(2):
                with pytest.raises(StoreUnavailable, match="TimeoutError"):
                    await store.budget_consume("b", 1, limit=10, window_s=60)
            for op in (lambda: store.rate_limit("k", 1, 1), lambda: store.acquire_concurrency("c", 1),
                       lambda: store.idempotency_begin("i", "fp")):
                with pytest.raises(StoreUnavailable, match="circuit open after 2 consecutive failures.*fail_closed"):
                    await op()
            assert store.breaker.skipped == 3
        finally:
            redis_server.resume()
        await store.close()

    asyncio.run(main())


def test_a_socket_that_accepts_and_never_answers():
    """Not redis at all: the kernel completes the handshake, nothing ever replies."""
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        url = f"redis://127.0.0.1:{listener.getsockname()[1]}/0"

        async def main():
            store = RedisStore(url, "fail_open", timeout_s=0.2, breaker=CircuitBreaker(threshold=3, cooldown_s=60))
            decisions = [await store.rate_limit("k", rate=1, burst=1) for _ in range(10)]
            assert all(d.degraded for d in decisions)
            assert store.breaker.state == OPEN and store.breaker.skipped == 7
            await store.close()

        asyncio.run(main())
