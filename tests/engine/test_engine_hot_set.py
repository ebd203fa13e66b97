"""The dynamic hot set: routing counts gathered while serving pick the experts kept at the exact format
(mixed precision in host memory, the CPU-only case) or on the GPU; swaps are packed from the checkpoint
and applied between steps; execution's numerics never move."""

from __future__ import annotations

import pytest
import torch

from engine.experts import DynamicHotConfig, PlacementConfig
from engine.llm_engine import LLM
from engine.sampling_params import SamplingParams
from kernels import pack_experts
from tests.engine.conftest import run_requests

N_EXPERTS = 8


def _placement(**dynamic) -> PlacementConfig:
    return PlacementConfig(fast_format="int4", exact_format="bf16", execution_format="bf16",
                           mixed_hot_fraction=0.25, hot_strategy="dynamic",
                           dynamic=DynamicHotConfig(**{"interval_steps": 2, "threshold": 0.0, "max_swaps": 4, **dynamic}))


@pytest.fixture(scope="module")
def ckpt(hf_checkpoint):
    return hf_checkpoint("qwen3_moe", num_experts_per_tok=2, num_hidden_layers=2)


def _llm(ckpt, placement: PlacementConfig) -> LLM:
    return LLM(ckpt, placement=placement, num_kv_blocks=128, block_size=8, max_num_batched_tokens=32, progress=False)


def _run(llm: LLM, requests) -> dict[str, list[int]]:
    return run_requests(llm.engine, requests)


def _skew(engine, hot: dict[int, list[int]], amount: int = 1000) -> None:
    """Routing counts as if traffic had gone to `hot[layer]` experts."""
    for i, le in engine.layer_experts.items():
        le.counts[hot[i]] += amount


def _settle(engine) -> None:
    """Runs interval boundaries until the proposed swaps are packed and applied."""
    hs = engine.hot_set
    for _ in range(hs.config.interval_steps):
        hs.between_steps()
    hs.drain()
    hs.between_steps()


def test_swaps_follow_the_routing_and_slots_hold_the_right_weights(ckpt):
    llm = _llm(ckpt, _placement())
    engine = llm.engine
    hs = engine.hot_set
    start = {i: set(le.fast[0].packed.expert_ids) for i, le in engine.layer_experts.items()}
    assert all(len(ids) == 2 for ids in start.values())  # 25% of 8 experts at bf16, uniform start: 0, 1
    target = {i: [5, 6] for i in engine.layer_experts}
    before_explore = engine.numerics_fingerprint("exploration")
    before_exec = engine.numerics_fingerprint("execution")
    _skew(engine, target)
    _settle(engine)
    for i, le in engine.layer_experts.items():
        upper, lower = le.fast
        assert set(upper.packed.expert_ids) == {5, 6}
        assert set(lower.packed.expert_ids) == set(range(N_EXPERTS)) - {5, 6}
        for shard in (upper, lower):  # every slot holds its expert packed as the loader packs it
            for slot, e in enumerate(shard.packed.expert_ids):
                gate_up, down = engine.runner.model.expert_reader(i, e)
                one = pack_experts(gate_up[None], down[None], shard.packed.fmt, progress=False)
                for name, t in one.tensors.items():
                    if t.numel():
                        assert torch.equal(shard.packed.tensors[name][slot], t[0]), (i, e, name)
    assert hs.stats()["swaps"] == 2 * len(engine.layer_experts) and hs.version == 1
    assert engine.numerics_fingerprint("exploration") != before_explore
    assert engine.numerics_fingerprint("execution") == before_exec


def test_exploration_after_swaps_equals_an_engine_started_with_that_hot_set(ckpt, tmp_path):
    from kernels import save_stats

    llm = _llm(ckpt, _placement())
    engine = llm.engine
    target = {i: [3, 7] for i in engine.layer_experts}
    _skew(engine, target)
    _settle(engine)
    stats = tmp_path / "stats.json"
    save_stats(stats, [[1000.0 if e in target[i] else 0.0 for e in range(N_EXPERTS)] for i in sorted(target)])
    static = _llm(ckpt, PlacementConfig(fast_format="int4", exact_format="bf16", execution_format="bf16",
                                        mixed_hot_fraction=0.25, stats_file=str(stats)))
    assert all(set(le.fast[0].packed.expert_ids) == {3, 7} for le in static.engine.layer_experts.values())
    prompts = [list(range(1, 20)), list(range(30, 41))]
    reqs = [(f"p{k}", p, SamplingParams(max_tokens=6, ignore_eos=True), "exploration") for k, p in enumerate(prompts)]
    engine.hot_set.config = DynamicHotConfig(interval_steps=10_000)  # no further swaps during this comparison
    assert _run(llm, reqs) == _run(static, reqs)


def test_traffic_flows_through_swaps_and_execution_bytes_never_move(ckpt):
    llm = _llm(ckpt, _placement(interval_steps=1))
    engine = llm.engine
    g = torch.Generator().manual_seed(0)
    exec_prompt = torch.randint(1, 400, (23,), generator=g).tolist()
    exec_req = ("x0", exec_prompt, SamplingParams(max_tokens=8, ignore_eos=True), "execution")
    ref = _run(llm, [exec_req])["x0"]
    versions = []
    for rep in range(3):
        reqs = [(f"e{rep}_{k}", torch.randint(1, 400, (int(n),), generator=g).tolist(),
                 SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, seed=k), "exploration")
                for k, n in enumerate(torch.randint(4, 30, (5,), generator=g))]
        _skew(engine, {i: [(2 * rep) % N_EXPERTS, (2 * rep + 5) % N_EXPERTS] for i in engine.layer_experts}, 500)
        done = _run(llm, [*reqs, (f"x{rep + 1}", exec_prompt, exec_req[2], "execution")])
        assert all(len(done[r[0]]) == 12 for r in reqs)  # every stream completed across the swaps
        assert done[f"x{rep + 1}"] == ref
        versions.append(engine.hot_set.version)
    assert versions[-1] > 0 and engine.hot_set.stats()["hit_rate"] > 0
    assert engine.blocks.num_free == 128


def test_configuration_errors_are_clear():
    with pytest.raises(ValueError, match="needs hot_experts"):
        PlacementConfig(fast_format="int4", hot_strategy="dynamic")
    with pytest.raises(ValueError, match="not both"):
        PlacementConfig(fast_format="int4", hot_strategy="dynamic", hot_experts=2, mixed_hot_fraction=0.25)
    with pytest.raises(ValueError, match="interval_steps"):
        DynamicHotConfig(interval_steps=0)
    with pytest.raises(ValueError, match="stats_file"):
        PlacementConfig(fast_format="int4", mixed_hot_fraction=0.25)


def test_routing_counts_record_matches_bincount():
    """LayerExperts.record adds each valid expert id once (-1: no expert) to the layer's counts, in place, as a
    torch bincount of the valid ids would; also for ids made in inference mode (the forward's)."""
    from engine.experts import LayerExperts

    gen = torch.Generator().manual_seed(0)
    le = LayerExperts(fast=[], exact=[], counts=torch.zeros(16, dtype=torch.long))
    counts, want = le.counts, torch.zeros(16, dtype=torch.long)
    for t in range(1, 9):
        with torch.inference_mode():
            ids = torch.randint(-1, 16, (t, 4), generator=gen)
            le.record(ids)
        want += torch.bincount(ids[ids >= 0], minlength=16)
    assert le.counts is counts and torch.equal(counts, want) and int(want.sum()) > 0
