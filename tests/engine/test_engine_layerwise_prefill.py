"""Layer-wise prefill: long exploration bursts run routed experts on the fast device (played here by the
CPU: the same code path), copying the next MoE layer while this one computes; execution never does."""

from __future__ import annotations

import pytest
import torch

from engine.experts import PlacementConfig
from engine.layerwise_prefill import LayerwisePrefill, LayerwisePrefillError, copy_to_device
from engine.llm_engine import LLM
from engine.sampling_params import LogitsRecorder, SamplingParams


@pytest.fixture(scope="module")
def ckpt(hf_checkpoint):
    return hf_checkpoint("qwen3_moe", num_experts_per_tok=2, num_hidden_layers=3)


def _llm(ckpt, fmt: str = "fp32", **kw) -> LLM:
    return LLM(ckpt, placement=PlacementConfig(fast_format=fmt, exact_format=fmt), num_kv_blocks=128, block_size=8,
               max_num_batched_tokens=64, prefix_cache=False, progress=False, **kw)


def _first_logits(llm: LLM, prompt: list[int], mode: str = "exploration") -> torch.Tensor:
    rec = LogitsRecorder()
    llm.engine.add_request("r", prompt, SamplingParams(max_tokens=1, logits_processors=[rec]), mode=mode)
    while llm.engine.has_work():
        llm.engine.step()
    return rec.rows[0]


PROMPT = list(range(3, 50))  # one 47-token prefill chunk


def test_off_by_default_on_the_cpu_and_on_when_asked(ckpt):
    assert _llm(ckpt).engine.runner.experts.layerwise is None  # auto: no gain where the experts' cores are the device's
    llm = _llm(ckpt, layerwise_prefill_tokens=16)
    assert llm.engine.runner.experts.layerwise.min_tokens == 16
    assert (llm.engine.numerics_fingerprint("exploration") != _llm(ckpt).engine.numerics_fingerprint("exploration"))
    assert llm.engine.numerics_fingerprint("execution") == _llm(ckpt).engine.numerics_fingerprint("execution")


def test_copied_experts_equal_the_packed_ones(ckpt):
    llm = _llm(ckpt, fmt="int4")
    for le in llm.engine.layer_experts.values():
        w = copy_to_device(le, torch.device("cpu"), torch.float32)
        packed = le.fast[0].packed
        for local, e in enumerate(packed.expert_ids):
            gu, dn = packed.dequantize(local)
            row = int(w.lut[e])
            assert torch.equal(w.gate_up[row], gu) and torch.equal(w.down[row], dn)


def test_long_burst_on_the_device_matches_the_cpu_kernels(ckpt):
    ref = _first_logits(_llm(ckpt), PROMPT)
    llm = _llm(ckpt, layerwise_prefill_tokens=16)
    got = _first_logits(llm, PROMPT)
    lw = llm.engine.runner.experts.layerwise
    assert lw.bursts == 3  # every MoE layer of the 47-token chunk ran on the fast device
    assert lw.copies == 4  # three layers, and the first again (a long prompt's next chunk wraps around)
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)  # fp32 experts: the same weights, another GEMM


def test_short_chunks_and_execution_stay_on_the_cpu_kernels(ckpt):
    llm = _llm(ckpt, layerwise_prefill_tokens=16)
    _first_logits(llm, list(range(3, 12)))  # 9 tokens: below the threshold; decode steps too
    assert llm.engine.runner.experts.layerwise.bursts == 0
    plain = _first_logits(_llm(ckpt), PROMPT, "execution")
    got = _first_logits(llm, PROMPT, "execution")
    assert llm.engine.runner.experts.layerwise.bursts == 0
    assert torch.equal(got, plain)  # execution's bytes do not depend on the threshold


def test_prefetch_overlaps_and_failures_surface(ckpt):
    llm = _llm(ckpt, layerwise_prefill_tokens=16)
    layers = [llm.engine.layer_experts[i] for i in sorted(llm.engine.layer_experts)]
    order = []

    class Recording(LayerwisePrefill):
        def _fetch(self, k):
            order.append(("fetch", k))
            return super()._fetch(k)

    lw = Recording(layers, "cpu", torch.float32, 16)
    x = torch.randn(20, layers[0].fast[0].packed.hidden)
    ids = torch.randint(0, 8, (20, 2))
    w = torch.rand(20, 2)
    lw.compute(layers[0], x, ids, w)
    assert order == [("fetch", 0), ("fetch", 1)]  # layer 1 was being copied while layer 0 computed
    assert set(lw._copies) == {1}
    lw.compute(layers[1], x, ids, w)
    assert set(lw._copies) == {2}  # at most the successor stays resident

    broken = LayerwisePrefill(layers, "cpu", torch.float32, 16)
    broken.layers = [None] * len(layers)  # copying fails in the background thread
    with pytest.raises(LayerwisePrefillError, match="MoE layer 0"):
        broken.compute(layers[0], x, ids, w)
    assert broken._copies == {}
    with pytest.raises(ValueError, match="min_tokens"):
        LayerwisePrefill(layers, "cpu", torch.float32, 0)
