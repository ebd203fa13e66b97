"""Hybrid placement on CUDA: dense path on the GPU, routed experts on the CPU, hot experts on the GPU."""

from __future__ import annotations

import pytest
import torch

from engine.experts import PlacementConfig
from engine.llm_engine import LLM
from engine.sampling_params import LogitsRecorder, SamplingParams

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _first_logits(path, device: str, placement: PlacementConfig) -> torch.Tensor:
    llm = LLM(path, device=device, placement=placement, num_kv_blocks=32, block_size=8, progress=False)
    rec = LogitsRecorder()
    llm.generate([list(range(5, 30))], SamplingParams(max_tokens=4, ignore_eos=True, logits_processors=[rec]))
    return torch.stack(rec.rows)


def test_dense_on_gpu_experts_on_cpu_match_cpu_only(hf_checkpoint):
    path = hf_checkpoint("qwen2_moe")
    placement = PlacementConfig(fast_format="fp32", exact_format="fp32")
    gpu = _first_logits(path, "cuda", placement)
    cpu = _first_logits(path, "cpu", placement)
    assert (gpu - cpu).abs().max().item() < 1e-3


def test_hot_experts_on_gpu_match_all_on_cpu(hf_checkpoint):
    path = hf_checkpoint("qwen3_moe")
    cold = _first_logits(path, "cuda", PlacementConfig(fast_format="bf16", exact_format="bf16"))
    hot = _first_logits(path, "cuda", PlacementConfig(fast_format="bf16", exact_format="bf16", hot_experts=3))
    assert (hot - cold).abs().max().item() < 1e-2


def test_greedy_tokens_on_gpu_equal_transformers(hf_checkpoint):
    import transformers as tf

    path = hf_checkpoint("qwen3_moe")
    prompt = list(range(5, 30))
    ref = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=8, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(prompt):]
    llm = LLM(path, device="cuda", placement=PlacementConfig(fast_format="fp32", exact_format="fp32"),
              num_kv_blocks=32, block_size=8, progress=False)
    out = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert out.token_ids == want.tolist()


def test_routed_experts_are_not_on_the_gpu(hf_checkpoint):
    path = hf_checkpoint("qwen3_moe")
    llm = LLM(path, device="cuda", placement=PlacementConfig(fast_format="int4", exact_format="int4"),
              num_kv_blocks=32, block_size=8, progress=False)
    model = llm.engine.runner.model
    on_gpu = {n for n, p in model.named_parameters() if p.device.type == "cuda" and p.numel()}
    assert on_gpu and not any("experts" in n for n in on_gpu)
    for le in llm.engine.layer_experts.values():
        assert all(s.device.type == "cpu" for s in le.fast + le.exact)


def test_layerwise_prefill_on_gpu_matches_cpu_kernels(hf_checkpoint):
    path = hf_checkpoint("qwen3_moe")
    placement = PlacementConfig(fast_format="fp32", exact_format="fp32")
    prompt = list(range(3, 60))

    def first(**kw):
        llm = LLM(path, device="cuda", placement=placement, num_kv_blocks=64, block_size=8, prefix_cache=False,
                  progress=False, **kw)
        rec = LogitsRecorder()
        llm.generate([prompt], SamplingParams(max_tokens=1, logits_processors=[rec]))
        return rec.rows[0], llm

    ref, _ = first(layerwise_prefill_tokens=None)
    got, llm = first(layerwise_prefill_tokens=16)
    assert llm.engine.runner.experts.layerwise.bursts > 0
    assert (got - ref).abs().max().item() < 1e-3


def test_dynamic_hot_set_on_gpu_swaps_between_steps(hf_checkpoint):
    from engine.experts import DynamicHotConfig

    path = hf_checkpoint("qwen3_moe")
    placement = PlacementConfig(fast_format="int4", exact_format="bf16", execution_format="bf16", hot_experts=2,
                                hot_strategy="dynamic", dynamic=DynamicHotConfig(interval_steps=1, threshold=0.0))
    llm = LLM(path, device="cuda", placement=placement, num_kv_blocks=64, block_size=8, progress=False)
    engine = llm.engine
    for le in engine.layer_experts.values():
        assert le.fast[0].device.type == "cuda" and all(s.device.type == "cpu" for s in le.exact)
        le.counts[[5, 6]] += 1000
    hs = engine.hot_set
    hs.between_steps()
    hs.drain()
    hs.between_steps()
    for le in engine.layer_experts.values():
        assert set(le.fast[0].packed.expert_ids) == {5, 6}
    out = llm.generate([list(range(5, 30))], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
