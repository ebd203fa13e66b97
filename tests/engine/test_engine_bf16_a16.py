"""bf16_a16 (bf16 weights, bf16-rounded activations: llama.cpp BF16's arithmetic) as the engine's routed-expert
format, alone and with the attention projections and lm_head in it too (the fused decode path): drift against the
fp32 path on a random Qwen3-MoE, teacher-forced, beside bf16 (the same weights with fp32 activations)."""

from __future__ import annotations

import torch

from tests.engine.conftest import format_drift, random_prompts


def test_bf16_a16_experts_and_everything_through_the_engine(hf_checkpoint):
    path = hf_checkpoint("qwen3_moe", num_experts_per_tok=4, num_hidden_layers=3)
    runs = {"bf16": dict(fmt="bf16"), "bf16_a16": dict(fmt="bf16_a16"),
            "bf16_a16 everything": dict(fmt="bf16_a16", fast_dense="bf16_a16", fast_lm_head="bf16_a16")}
    rows, kl, top1 = format_drift(path, random_prompts(5, 71), runs)
    assert not torch.equal(rows["bf16_a16"], rows["bf16"])  # the activations really were rounded
    for name in runs:
        assert 0 <= kl[name] <= 0.01 and top1[name] >= 0.9, name
