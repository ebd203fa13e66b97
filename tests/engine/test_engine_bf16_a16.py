"""bf16_a16 (bf16 weights, bf16-rounded activations: llama.cpp BF16's arithmetic) as the engine's routed-expert
format, alone and with the attention projections and lm_head in it too (the fused decode path): drift against the
fp32 path on a random Qwen3-MoE, teacher-forced, beside bf16 (the same weights with fp32 activations)."""

from __future__ import annotations

import torch

from engine.experts import PlacementConfig
from engine.llm_engine import LLM
from engine.sampling_params import SamplingParams
from tests.engine.conftest import drift, teacher_forced_rows

STEPS = 8


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 500, (int(torch.randint(4, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_bf16_a16_experts_and_everything_through_the_engine(hf_checkpoint):
    path = hf_checkpoint("qwen3_moe", num_experts_per_tok=4, num_hidden_layers=3)
    prompts = _prompts(5, 71)
    args = dict(num_kv_blocks=128, block_size=8, progress=False)
    exact = LLM(path, **args)
    params = SamplingParams(max_tokens=STEPS, ignore_eos=True)
    reference = [o.token_ids for o in exact.generate(prompts, params)]
    base = teacher_forced_rows(exact, prompts, reference)
    runs = {"bf16": dict(fmt="bf16"), "bf16_a16": dict(fmt="bf16_a16"),
            "bf16_a16 everything": dict(fmt="bf16_a16", fast_dense="bf16_a16", fast_lm_head="bf16_a16")}
    rows, kl, top1 = {}, {}, {}
    for name, cfg in runs.items():
        fmt = cfg.pop("fmt")
        llm = LLM(path, placement=PlacementConfig(fast_format=fmt, exact_format=fmt), **cfg, **args)
        rows[name] = teacher_forced_rows(llm, prompts, reference)
        kl[name], top1[name] = drift(rows[name], base)
    print({name: (f"KL {kl[name]:.2e}", f"top-1 {top1[name]:.3f}") for name in runs})
    assert not torch.equal(rows["bf16_a16"], rows["bf16"])  # the activations really were rounded
    for name in runs:
        assert 0 <= kl[name] <= 0.01 and top1[name] >= 0.9, name
