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
