"""admit()/settle(): a resolved policy's limits enforced through MemoryStore and a real redis-server."""

import asyncio
from pathlib import Path

import pytest
from redis_process import RedisProcess

from gateway.limits import LimitExceeded, admit, settle
from gateway.stores import MemoryStore, StoreUnavailable
from gateway.stores.redis_store import RedisStore
from policies import load_policy
from policies.model import Limits

EXAMPLES = Path(__file__).resolve().parents[2] / "policies" / "examples"


def test_finance_limits_through_memory_store():
    limits = load_policy(EXAMPLES / "finance.yaml").resolve("research", "/v1/chat/completions", "qwen3-moe").limits
    assert limits.requests_per_min == 30 and limits.request_burst == 20 and limits.concurrency == 4

    async def main():
        store = MemoryStore()
        with pytest.raises(LimitExceeded) as info:
            await admit(store, limits, "research", 10, max_tokens=4096)
        assert info.value.limit == "max_tokens" and info.value.retry_after is None
        held = [await admit(store, limits, "research", 10, max_tokens=None) for _ in range(4)]
        assert held[0].max_tokens == 2048  # policy cap applied when the request gave none
        with pytest.raises(LimitExceeded) as info:
            await admit(store, limits, "research", 10, max_tokens=16)
        assert info.value.limit == "concurrency"
        for a in held:
            await a.release()
        for _ in range(15):  # 4 + 1 + 15 = 20 = request_burst
            async with await admit(store, limits, "research", 10, max_tokens=16):
                pass
        with pytest.raises(LimitExceeded) as info:
            await admit(store, limits, "research", 10, max_tokens=16)
        assert info.value.limit == "requests_per_min" and 1.5 < info.value.retry_after <= 2.0  # 30/min

    asyncio.run(main())


def test_token_rate_and_daily_budget():
    limits = Limits(tokens_per_min=6000, token_burst=1000, tokens_per_day=1500, concurrency=2)

    async def main():
        store = MemoryStore()
        a = await admit(store, limits, "t", prompt_tokens=400, max_tokens=500)  # 900 of 1000 burst
        await a.release()
        with pytest.raises(LimitExceeded) as info:
            await admit(store, limits, "t", prompt_tokens=100, max_tokens=100)
        assert info.value.limit == "tokens_per_min" and info.value.retry_after == pytest.approx(1.0, abs=0.1)
        assert (await store.acquire_concurrency("t:conc", 2)) is not None  # the refused request freed its slot
        with pytest.raises(LimitExceeded) as info:
            await admit(store, limits, "u", prompt_tokens=1000, max_tokens=1)
        assert info.value.retry_after is None  # more than the burst can ever hold
        await settle(store, limits, "v", 1600)
        with pytest.raises(LimitExceeded) as info:
            await admit(store, limits, "v", prompt_tokens=1, max_tokens=1)
        assert info.value.limit == "tokens_per_day" and 0 < info.value.retry_after <= 86400

    asyncio.run(main())


@pytest.mark.redis
def test_admission_fail_open_and_closed_with_redis_down(tmp_path):
    server = RedisProcess(tmp_path)
    server.start()
    limits = Limits(requests_per_min=60, concurrency=1)

    async def main():
        open_store = RedisStore(server.url, "fail_open")
        closed_store = RedisStore(server.url, "fail_closed")
        a = await admit(closed_store, limits, "t", 1, 1)
        assert not a.degraded
        with pytest.raises(LimitExceeded):
            await admit(closed_store, limits, "t", 1, 1)
        await a.release()
        server.kill()
        with pytest.raises(StoreUnavailable):
            await admit(closed_store, limits, "t", 1, 1)
        degraded = await admit(open_store, limits, "t", 1, 1)
        assert degraded.degraded
        await degraded.release()
        server.start()
        assert not (await admit(open_store, limits, "t", 1, 1)).degraded
        await open_store.close()
        await closed_store.close()

    try:
        asyncio.run(main())
    finally:
        server.kill()
