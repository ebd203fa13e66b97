"""Redis prefix cache tier against a real redis-server: shared by replicas, verified, TTL, outage is a miss."""

from __future__ import annotations

import pytest
import torch

from engine.llm_engine import EngineConfig, LLMEngine
from engine.prefix_cache.entry import EntryCodec
from engine.prefix_cache.redis_tier import RedisTier
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.redis


def _generate(engine: LLMEngine, prompt: list[int]):
    engine.add_request("r", prompt, SamplingParams(max_tokens=5, ignore_eos=True), cache_salt="tenant")
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                return out
    raise AssertionError("no output")


def test_redis_tier_round_trip_ttl_and_corruption(redis_server):
    codec = EntryCodec("f" * 64, (2, 2, 4, 2, 8), torch.float32)
    tier = RedisTier(redis_server.url, codec, ttl_s=100)
    kv = torch.randn(codec.shape)
    tier.put("k1", kv)
    assert torch.equal(tier.get("k1"), kv) and "k1" in tier and tier.get("k2") is None
    redis_key = tier.prefix + "k1"
    assert 0 < int(redis_server.command("TTL", redis_key).split(b"\r\n")[0][1:]) <= 100
    redis_server.command("SETRANGE", redis_key, "200", "garbage")  # damage the payload in place
    assert tier.get("k1") is None and tier.stats.corrupt == 1 and "k1" not in tier
    redis_server.kill()
    assert tier.get("k1") is None and tier.stats.errors >= 1  # an outage is a miss, not a failure
    tier.close()


def test_a_second_replica_reuses_the_first_replicas_blocks(hf_checkpoint, redis_server):
    path = hf_checkpoint("qwen3_moe")
    prompt = torch.randint(1, 500, (50,), generator=torch.Generator().manual_seed(0)).tolist()
    args = dict(num_kv_blocks=64, block_size=4, progress=False, ram_cache_gib=0, redis_url=redis_server.url)
    want = _generate(LLMEngine(EngineConfig(str(path), num_kv_blocks=64, block_size=4, progress=False,
                                            prefix_cache=False)), prompt).token_ids
    first = LLMEngine(EngineConfig(str(path), **args))
    assert _generate(first, prompt).num_cached_tokens == 0
    first.close()  # demotes its blocks to redis
    second = LLMEngine(EngineConfig(str(path), **args))  # another replica: empty device pool
    out = _generate(second, prompt)
    assert out.token_ids == want and out.cache_hits == {"redis": 12} and out.num_cached_tokens == 48
    assert second.cache_stats()["redis"]["hits"] == 12
    second.close()


def test_replicas_share_blocks_while_both_are_live(hf_checkpoint, redis_server):
    """Written through: the second replica reuses what the first computed, with the first still running
    (nothing evicted, nothing shut down)."""
    path = hf_checkpoint("qwen3_moe")
    prompt = torch.randint(1, 500, (50,), generator=torch.Generator().manual_seed(1)).tolist()
    args = dict(num_kv_blocks=64, block_size=4, progress=False, redis_url=redis_server.url)
    first, second = LLMEngine(EngineConfig(str(path), **args)), LLMEngine(EngineConfig(str(path), **args))
    want = _generate(first, prompt)
    assert want.num_cached_tokens == 0
    first.prefix_cache.drain()  # the asynchronous writes have landed
    stats = first.cache_stats()
    computed = (50 + 5 - 1) // 4  # full blocks of prompt and output (the last sampled token is not computed)
    assert stats["redis"]["writes"] == computed and stats["redis"]["dropped"] == 0
    assert stats["ram"]["entries"] == 0 and stats["device"]["evictions"] == 0  # written through, not demoted
    out = _generate(second, prompt)
    assert out.token_ids == want.token_ids and out.cache_hits == {"redis": 12} and out.num_cached_tokens == 48
    first.close()
    assert first.cache_stats()["redis"]["writes"] == computed  # the flush at shutdown found them already there
    second.close()


def test_a_full_write_queue_drops_and_counts(hf_checkpoint, redis_server):
    path = hf_checkpoint("qwen3_moe")
    engine = LLMEngine(EngineConfig(str(path), num_kv_blocks=64, block_size=4, progress=False,
                                    redis_url=redis_server.url))
    # a queue smaller than one block: every write-through is dropped, counted, never blocks the engine
    engine.prefix_cache.writers["redis"].max_pending_bytes = engine.prefix_cache.codec.payload_bytes - 1
    _generate(engine, list(range(1, 51)))
    engine.prefix_cache.drain()
    stats = engine.cache_stats()
    computed = (50 + 5 - 1) // 4
    assert stats["redis"]["dropped"] == computed and stats["writer"]["dropped"] == computed
    assert stats["redis"]["writes"] == 0
    assert redis_server.command("DBSIZE") == b":0\r\n"
    engine.prefix_cache.close()


def test_hung_redis_is_skipped_after_the_breaker_opens(hf_checkpoint, redis_server):
    """SIGSTOP: lookups and writes time out `threshold` times, then the tier is not called until a probe."""
    path = hf_checkpoint("qwen3_moe")
    prompt = list(range(1, 51))
    args = dict(num_kv_blocks=64, block_size=4, progress=False, prefix_cache=False)
    want = _generate(LLMEngine(EngineConfig(str(path), **args)), prompt).token_ids
    engine = LLMEngine(EngineConfig(str(path), **{**args, "prefix_cache": True, "redis_url": redis_server.url}))
    tier = engine.prefix_cache.tier("redis")
    redis_server.pause()
    try:
        assert _generate(engine, prompt).token_ids == want  # a hung shared tier is a miss, not a failure
        engine.prefix_cache.drain()
        stats = engine.cache_stats()["redis"]
        assert tier.breaker.state == "open" and tier.breaker.opened == 1
        assert stats["errors"] == tier.breaker.threshold  # the calls that reached the hung server
        assert stats["skipped"] > 0 and stats["hits"] == 0  # the others were not made
    finally:
        redis_server.resume()
    engine.prefix_cache.close()
