"""The store contract, run against MemoryStore and a real redis-server: limits, leases, budgets, idempotency."""

import asyncio
import math
import time

import pytest
from redis_process import RedisProcess

from gateway.stores import (
    IdempotencyKeyMismatch,
    IdemState,
    MemoryStore,
    StoredResponse,
    make_store,
    request_fingerprint,
)
from gateway.stores.redis_store import RedisStore


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = RedisProcess(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.kill()


@pytest.fixture(params=["memory", pytest.param("redis", marks=pytest.mark.redis)])
def make(request):
    """A factory (called inside the test's event loop) for a fresh store of the given backend."""
    if request.param == "memory":
        return MemoryStore
    server = request.getfixturevalue("redis_server")
    assert server.command("FLUSHALL").startswith(b"+OK")
    return lambda: RedisStore(server.url, "fail_closed")


def run(coro):
    return asyncio.run(coro)


def test_rate_limit_token_bucket(make):
    async def main():
        store = make()
        decisions = [await store.rate_limit("t1", rate=20.0, burst=3) for _ in range(4)]
        assert [d.allowed for d in decisions] == [True, True, True, False]
        assert 0.0 < decisions[3].retry_after <= 0.05 + 1e-6 and decisions[0].retry_after == 0.0
        assert not any(d.degraded for d in decisions)
        await asyncio.sleep(decisions[3].retry_after + 0.01)
        assert (await store.rate_limit("t1", rate=20.0, burst=3)).allowed
        assert (await store.rate_limit("other", rate=20.0, burst=3)).allowed  # keys are independent
        big = await store.rate_limit("t2", rate=1000.0, burst=100, cost=101)
        assert not big.allowed and math.isinf(big.retry_after)
        costly = await store.rate_limit("t3", rate=10.0, burst=100, cost=60)
        assert costly.allowed and costly.remaining == pytest.approx(40, abs=0.5)
        again = await store.rate_limit("t3", rate=10.0, burst=100, cost=60)
        assert not again.allowed and again.retry_after == pytest.approx(2.0, abs=0.1)
        await store.close()

    run(main())


def test_concurrency_leases(make):
    async def main():
        store = make()
        a = await store.acquire_concurrency("c", limit=2)
        b = await store.acquire_concurrency("c", limit=2)
        assert a is not None and b is not None
        assert await store.acquire_concurrency("c", limit=2) is None
        await a.release()
        await a.release()  # idempotent: must not free a second slot
        async with await store.acquire_concurrency("c", limit=2) as c:
            assert c is not None and await store.acquire_concurrency("c", limit=2) is None
        assert await b.renew(60)
        short = await store.acquire_concurrency("d", limit=1, ttl_s=0.1)
        assert await store.acquire_concurrency("d", limit=1) is None
        await asyncio.sleep(0.15)  # a crashed holder's slot frees itself
        assert not await short.renew(60)
        assert await store.acquire_concurrency("d", limit=1) is not None
        await store.close()

    run(main())


def test_budget_windows(make):
    async def main():
        store = make()
        assert (await store.budget_consume("b", 60, limit=100, window_s=3600)).allowed
        denied = await store.budget_consume("b", 50, limit=100, window_s=3600)
        assert not denied.allowed and denied.used == 60 and 0 < denied.reset_after <= 3600
        ok = await store.budget_consume("b", 40, limit=100, window_s=3600)
        assert ok.allowed and ok.used == 100
        over = await store.budget_consume("b", 25, limit=100, window_s=3600, force=True)
        assert not over.allowed and over.used == 125
        # a 1-second window rolls over
        first = await store.budget_consume("w", 5, limit=5, window_s=1)
        assert first.allowed and not (await store.budget_consume("w", 1, limit=5, window_s=1)).allowed
        await asyncio.sleep(first.reset_after + 0.05)
        rolled = await store.budget_consume("w", 1, limit=5, window_s=1)
        assert rolled.allowed and rolled.used == 1
        await store.close()

    run(main())


def test_idempotency_repeat_returns_stored_response(make):
    async def main():
        store = make()
        fp = request_fingerprint("POST", "/v1/chat/completions", {"model": "m", "messages": []})
        first = await store.idempotency_begin("tenant:k1", fp)
        assert first.state is IdemState.NEW and first.token
        response = StoredResponse(200, b'{"id":"chatcmpl-1"}', (("content-type", "application/json"),))
        assert await store.idempotency_complete("tenant:k1", first.token, response)
        again = await store.idempotency_begin("tenant:k1", fp)
        assert again.state is IdemState.COMPLETED and again.response == response
        with pytest.raises(IdempotencyKeyMismatch):
            await store.idempotency_begin("tenant:k1", request_fingerprint("POST", "/v1/chat/completions", {}))
        assert not await store.idempotency_complete("tenant:k1", first.token, response)  # only once
        await store.close()

    run(main())


def test_fingerprint_ignores_key_order():
    assert request_fingerprint("post", "/x", {"a": 1, "b": [1, 2]}) == request_fingerprint("POST", "/x",
                                                                                          {"b": [1, 2], "a": 1})
    assert request_fingerprint("POST", "/x", {"a": 1}) != request_fingerprint("POST", "/y", {"a": 1})


def test_concurrent_duplicates_generate_once(make):
    async def main():
        store = make()
        generated = []

        async def handle(i):
            begin = await store.idempotency_begin("tenant:dup", "fp", wait_s=5)
            if begin.state is IdemState.COMPLETED:
                return begin.response.body
            assert begin.state is IdemState.NEW
            generated.append(i)
            await asyncio.sleep(0.2)  # generating
            body = f"generated by {i}".encode()
            assert await store.idempotency_complete("tenant:dup", begin.token, StoredResponse(200, body))
            return body

        bodies = await asyncio.gather(*(handle(i) for i in range(5)))
        assert len(generated) == 1 and set(bodies) == {f"generated by {generated[0]}".encode()}
        await store.close()

    run(main())


def test_abandoned_key_is_taken_over_and_wait_times_out(make):
    async def main():
        store = make()
        owner = await store.idempotency_begin("k", "fp")
        t0 = time.monotonic()
        timed_out = await store.idempotency_begin("k", "fp", wait_s=0.1)
        assert timed_out.state is IdemState.IN_PROGRESS and time.monotonic() - t0 >= 0.09

        async def fail_later():
            await asyncio.sleep(0.1)
            await store.idempotency_abandon("k", owner.token)

        waiter, _ = await asyncio.gather(store.idempotency_begin("k", "fp", wait_s=5), fail_later())
        assert waiter.state is IdemState.NEW and waiter.token != owner.token
        assert not await store.idempotency_complete("k", owner.token, StoredResponse(500, b"late"))
        assert await store.idempotency_complete("k", waiter.token, StoredResponse(200, b"ok"))
        assert (await store.idempotency_begin("k", "fp")).response.body == b"ok"
        # a crashed owner's lock expires: the next request takes over, the stale owner cannot complete
        stale = await store.idempotency_begin("k2", "fp", lock_ttl_s=0.1)
        await asyncio.sleep(0.15)
        fresh = await store.idempotency_begin("k2", "fp")
        assert fresh.state is IdemState.NEW
        assert not await store.idempotency_complete("k2", stale.token, StoredResponse(200, b"stale"))
        await store.close()

    run(main())


@pytest.mark.redis
def test_make_store_picks_backend(redis_server, monkeypatch):
    monkeypatch.delenv("REDIS_URL", raising=False)
    assert isinstance(make_store(), MemoryStore)
    assert isinstance(make_store(""), MemoryStore)
    monkeypatch.setenv("REDIS_URL", redis_server.url)
    store = make_store(on_unavailable="fail_open")
    assert isinstance(store, RedisStore) and store.on_unavailable == "fail_open"

    async def ping_and_close():
        try:
            return await store.ping()
        finally:
            await store.close()

    assert run(ping_and_close())
    with pytest.raises(ValueError, match="on_unavailable"):
        RedisStore(redis_server.url, "fail_sometimes")
