"""int8_a8 (W8A8: int8 weights and int8 activations per token and group of 32) through the engine: drift
against the fp32 path (transformers' logits: tests/engine/test_engine_parity.py) on a random Qwen3-MoE,
teacher-forced, beside int8 (the same weights with fp32 activations) and int4 (W4A8); and with the
attention projections and lm_head in int8_a8 too (the fused decode path, llama.cpp Q8_0's precision); and
every exploration lm_head format, bf16 included, on the CPU kernel."""

from __future__ import annotations

import torch

from engine.models.causal_lm import QuantizedLMHead
from tests.engine.conftest import format_drift, random_prompts


def test_w8a8_drift_against_fp32(hf_checkpoint):
    path = hf_checkpoint("qwen3_moe", num_experts_per_tok=4, num_hidden_layers=3)
    runs = {"int8": dict(fmt="int8"), "int8_a8": dict(fmt="int8_a8"), "int4": dict(fmt="int4"),
            "int8_a8 + attention + lm_head": dict(fmt="int8_a8", fast_dense="int8_a8", fast_lm_head="int8_a8")}
    rows, kl, top1 = format_drift(path, random_prompts(6, 61), runs)
    assert not torch.equal(rows["int8_a8"], rows["int8"])  # the activations really were quantized
    for name in ("int8", "int8_a8", "int8_a8 + attention + lm_head"):
        assert 0 < kl[name] <= 0.01 and top1[name] >= 0.9, name
    assert kl["int8_a8"] < kl["int4"]  # 8-bit weights and activations drift less than 4-bit weights


def test_every_cpu_lm_head_format_runs_the_kernel():
    """bf16 too (it ran torch's bf16 GEMV): bf16 weights times fp32 activations, within fp32 summation
    order of the dequantized matmul."""
    w = torch.randn(300, 64, generator=torch.Generator().manual_seed(3)) * 0.05  # [V, H]
    x = torch.randn(3, 64)
    for fmt in QuantizedLMHead.FORMATS:
        head = QuantizedLMHead(w, fmt)
        assert head.packed is not None and head.packed.fmt == fmt, fmt
        ref = head.packed.reference(x)
        assert (head(x) - ref).abs().max() <= 1e-4 * ref.abs().max() + 1e-5, fmt
    bf16 = QuantizedLMHead(w, "bf16")(x)
    assert (bf16 - x @ w.bfloat16().float().T).abs().max() <= 1e-5
