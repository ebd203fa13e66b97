"""Exploration's expert deferral switched at run time equals an engine started with that setting."""

from __future__ import annotations

import pytest
import torch

from engine.experts import PlacementConfig
from engine.llm_engine import LLM
from engine.sampling_params import LogitsRecorder, SamplingParams

PLACEMENT = PlacementConfig(fast_format="int4", exact_format="bf16", formatting_layers=1)


@pytest.fixture(scope="module")
def ckpt(hf_checkpoint):
    return hf_checkpoint("qwen3_moe", num_experts_per_tok=4, num_hidden_layers=3)


def _llm(ckpt, **kw) -> LLM:
    return LLM(ckpt, placement=PLACEMENT, num_kv_blocks=256, block_size=8, max_num_batched_tokens=32,
               progress=False, **kw)


def _first_logits(llm: LLM, prompts: list[list[int]], tag: str) -> torch.Tensor:
    engine = llm.engine
    recs = [LogitsRecorder() for _ in prompts]
    for i, (p, r) in enumerate(zip(prompts, recs, strict=True)):
        engine.add_request(f"{tag}{i}", p, SamplingParams(max_tokens=1, logits_processors=[r]))
    while engine.has_work():
        engine.step()
    return torch.stack([r.rows[0] for r in recs])  # [P, V]


def test_set_deferral_matches_a_fresh_engine_both_ways(ckpt):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 500, (n,), generator=g).tolist() for n in (5, 17, 30)]
    strict_ref = _first_logits(_llm(ckpt, defer=0), prompts, "s")
    deferred_ref = _first_logits(_llm(ckpt, defer=1), prompts, "d")
    assert not torch.equal(strict_ref, deferred_ref)

    llm = _llm(ckpt, defer=1)
    before = llm.engine.numerics_fingerprint("exploration")
    llm.engine.set_deferral(0)
    assert llm.engine.runner.defer == 0 and llm.engine.config.defer == 0
    assert torch.equal(_first_logits(llm, prompts, "a"), strict_ref)
    assert llm.engine.numerics_fingerprint("exploration") != before
    assert llm.engine.numerics_fingerprint("exploration") == _llm(ckpt, defer=0).engine.numerics_fingerprint(
        "exploration")

    started_strict = _llm(ckpt, defer=0)
    assert started_strict.engine.runner.expert_worker is None
    started_strict.engine.set_deferral(1)  # the worker that runs deferred experts is created on demand
    assert torch.equal(_first_logits(started_strict, prompts, "b"), deferred_ref)

    with pytest.raises(ValueError, match="top_k/2"):
        llm.engine.set_deferral(3)


def test_sequences_in_flight_stop_caching_blocks_of_mixed_numerics(ckpt):
    llm = _llm(ckpt, defer=1)
    engine = llm.engine
    engine.add_request("running", list(range(1, 40)), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()  # the first prefill chunk ran under defer=1
    engine.add_request("waiting", list(range(1, 40)), SamplingParams(max_tokens=4, ignore_eos=True))
    running, waiting = engine._seqs["running"], engine._seqs["waiting"]
    engine.set_deferral(0)
    assert running.cache_root is None and running.block_hashes == []  # its KV mixes both settings
    fresh_root = engine.prefix_cache.salt_root("", engine.numerics_fingerprint("exploration"), False)
    assert waiting.num_computed == 0 and not waiting.block_table  # not scheduled yet
    assert waiting.cache_root == fresh_root  # nothing computed yet: cached under the new setting
    while engine.has_work():
        engine.step()
    assert engine.blocks.num_free == 256
