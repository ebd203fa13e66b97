"""Redis store across replicas and through an outage: a real redis-server killed mid-run and restarted."""

import asyncio
import time

import pytest

from engine.circuit_breaker import CircuitBreaker
from gateway.stores import IdemState, StoredResponse, StoreUnavailable
from gateway.stores.redis_store import RedisStore

pytestmark = pytest.mark.redis


def test_limits_are_atomic_across_replicas(redis_server):
    async def main():
        replicas = [RedisStore(redis_server.url) for _ in range(3)]
        decisions = await asyncio.gather(*(replicas[i % 3].rate_limit("tenant", rate=0.001, burst=10)
                                           for i in range(60)))
        assert sum(d.allowed for d in decisions) == 10
        leases = await asyncio.gather(*(replicas[i % 3].acquire_concurrency("tenant", limit=4)
                                        for i in range(30)))
        assert sum(lease is not None for lease in leases) == 4
        budgets = await asyncio.gather(*(replicas[i % 3].budget_consume("tenant", 7, limit=100, window_s=3600)
                                         for i in range(30)))
        assert sum(b.allowed for b in budgets) == 14 and max(b.used for b in budgets) == 98
        for r in replicas:
            await r.close()

    asyncio.run(main())


def test_duplicate_on_another_replica_waits_for_the_first(redis_server):
    async def main():
        a, b = RedisStore(redis_server.url), RedisStore(redis_server.url)
        first = await a.idempotency_begin("t:k", "fp")
        assert first.state is IdemState.NEW

        async def finish():
            await asyncio.sleep(0.2)
            assert await a.idempotency_complete("t:k", first.token, StoredResponse(201, b"once"))

        t0 = time.monotonic()
        dup, _ = await asyncio.gather(b.idempotency_begin("t:k", "fp", wait_s=5), finish())
        assert dup.state is IdemState.COMPLETED and dup.response == StoredResponse(201, b"once")
        assert 0.15 < time.monotonic() - t0 < 2
        await a.close()
        await b.close()

    asyncio.run(main())


def test_redis_killed_mid_run_and_restarted(redis_server):
    clock = [0.0]

    def breaker() -> CircuitBreaker:
        return CircuitBreaker(threshold=3, cooldown_s=5, clock=lambda: clock[0])

    async def main():
        open_store = RedisStore(redis_server.url, "fail_open", breaker=breaker())
        closed_store = RedisStore(redis_server.url, "fail_closed", breaker=breaker())
        assert (await open_store.rate_limit("k", rate=0.001, burst=1)).allowed
        assert not (await open_store.rate_limit("k", rate=0.001, burst=1)).allowed  # enforced while up
        assert (await closed_store.idempotency_begin("i", "fp")).state is IdemState.NEW

        redis_server.kill()

        # fail_open: every operation proceeds, marked degraded; nothing raises
        d = await open_store.rate_limit("k", rate=0.001, burst=1)
        assert d.allowed and d.degraded and not open_store.available
        lease = await open_store.acquire_concurrency("c", limit=1)
        assert lease is not None and lease.degraded
        await lease.release()
        assert (await open_store.budget_consume("b", 10, limit=1, window_s=60)).degraded
        begin = await open_store.idempotency_begin("i2", "fp")
        assert begin.state is IdemState.NEW and begin.degraded and begin.token is None
        assert not await open_store.idempotency_complete("i2", begin.token, StoredResponse(200, b""))
        assert not await open_store.ping()

        # fail_closed: every operation raises a typed error naming the policy choice
        for op in (lambda: closed_store.rate_limit("k", 1, 1), lambda: closed_store.acquire_concurrency("c", 1),
                   lambda: closed_store.budget_consume("b", 1, 1, 60),
                   lambda: closed_store.idempotency_begin("i3", "fp")):
            with pytest.raises(StoreUnavailable, match="fail_closed"):
                await op()

        redis_server.start()  # same port, empty data (no persistence)
        clock[0] += 5  # the circuit breakers' cool-down: the next call probes redis

        # the same client objects reconnect by themselves and enforce limits again
        assert (await closed_store.rate_limit("k", rate=0.001, burst=1)).allowed
        assert not (await closed_store.rate_limit("k", rate=0.001, burst=1)).allowed
        d = await open_store.rate_limit("k2", rate=0.001, burst=1)
        assert d.allowed and not d.degraded and open_store.available
        assert not (await open_store.rate_limit("k2", rate=0.001, burst=1)).allowed
        again = await closed_store.idempotency_begin("i", "fp")
        assert again.state is IdemState.NEW  # the old claim died with the old process
        await open_store.close()
        await closed_store.close()

    asyncio.run(main())


def test_traffic_survives_outage_fail_open(redis_server):
    """A steady request loop while redis dies and comes back: no errors escape, enforcement resumes."""

    async def main():
        store = RedisStore(redis_server.url, "fail_open", breaker=CircuitBreaker(threshold=3, cooldown_s=0.05))
        results = []

        async def traffic(stop):
            while not stop.is_set():
                lease = await store.acquire_concurrency("t", limit=100)
                d = await store.rate_limit("t", rate=1000.0, burst=1000)
                results.append((d.degraded, lease.degraded))
                await lease.release()
                await asyncio.sleep(0.005)

        stop = asyncio.Event()
        task = asyncio.create_task(traffic(stop))
        await asyncio.sleep(0.2)
        await asyncio.to_thread(redis_server.kill)
        await asyncio.sleep(0.3)
        await asyncio.to_thread(redis_server.start)
        await asyncio.sleep(0.3)
        stop.set()
        await task
        degraded = [r[0] for r in results]
        assert any(degraded) and not degraded[0] and not degraded[-1]  # up, down, up again
        assert not results[-1][1]
        assert await store.ping()
        await store.close()

    asyncio.run(main())


def test_burst_larger_than_the_pool_queues_instead_of_failing(redis_server):
    async def main():
        # a generous socket timeout: this is about queueing for the pool, and 300 coroutines on a busy
        # 2-core machine can hold the event loop past the default 0.5 s while the first sockets connect
        store = RedisStore(redis_server.url, "fail_closed", max_connections=4, timeout_s=5.0)
        decisions = await asyncio.gather(*(store.rate_limit("b", rate=0.001, burst=100) for _ in range(300)))
        assert sum(d.allowed for d in decisions) == 100 and not any(d.degraded for d in decisions)
        await store.close()

    asyncio.run(main())
