"""Paged causal GQA attention kernel (kernels.attention): the torch reference per compiled variant (group
sizes, head dims with a tail, sliding window, several sequences), bitwise row invariance over calls of
M = 1..16 tokens, the engine's Attention module against its torch path, and the reference's fallbacks."""

from __future__ import annotations

import pytest
import torch

from kernels import kernel_available
from kernels.attention import attention_reference, causal_contexts, kernel_takes, paged_attention
from kernels.cpu_features import detect, vnni_capable

needs_kernel = pytest.mark.skipif(not kernel_available(), reason="C++ kernel could not be built here")
VARIANTS = ["generic", "avx2", *(["avx512"] if vnni_capable(detect()) else [])]


def _case(nh: int, kv: int, d: int, q_lens: list[int], ctx_lens: list[int], seed: int = 0):
    """Random q, caches and each token's context for sequences of q_lens new tokens over ctx_lens."""
    gen = torch.Generator().manual_seed(seed)
    n_slots = sum(ctx_lens) + 7
    k_cache, v_cache = torch.randn(n_slots, kv, d, generator=gen), torch.randn(n_slots, kv, d, generator=gen)
    perm = torch.randperm(n_slots, generator=gen)  # scattered slots, as a paged cache hands them out
    ctx_slots, at = [], 0
    for n in ctx_lens:
        ctx_slots.append(perm[at : at + n])
        at += n
    q = torch.randn(sum(q_lens), nh, d, generator=gen) * 2
    return q, k_cache, v_cache, causal_contexts(q_lens, ctx_lens, ctx_slots)


def assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert (out - ref).abs().max().item() <= 1e-5 * ref.abs().max().item() + 1e-6


@needs_kernel
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("nh", "kv", "d"), [(4, 4, 64), (8, 2, 64), (16, 4, 128), (6, 1, 80), (2, 2, 7)])
@pytest.mark.parametrize("window", [None, 5])
def test_attention_matches_reference(variant: str, nh: int, kv: int, d: int, window: int | None) -> None:
    q, k_cache, v_cache, (slots, start, length) = _case(nh, kv, d, [20, 1, 6], [20, 33, 9])
    scale = d**-0.5
    out = paged_attention(q, k_cache, v_cache, slots, start, length, scale, window, variant=variant)
    assert_close(out, attention_reference(q, k_cache, v_cache, slots, start, length, scale, window))


@needs_kernel
def test_variants_agree_bitwise_where_both_use_avx2_lanes() -> None:
    q, k_cache, v_cache, ctx = _case(8, 2, 64, [40], [40], seed=1)
    outs = [paged_attention(q, k_cache, v_cache, *ctx, 0.125, variant=v) for v in VARIANTS if v != "generic"]
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@needs_kernel
def test_token_rows_are_bitwise_batch_invariant() -> None:
    """Each token's bits equal its bits when computed alone or in any contiguous call of M = 1..16 tokens,
    and on one thread or many: the same token in a prefill, a chunk, or a decode step."""
    q, k_cache, v_cache, (slots, start, length) = _case(16, 4, 64, [48], [48], seed=2)
    full = paged_attention(q, k_cache, v_cache, slots, start, length, 0.125)
    with_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(paged_attention(q, k_cache, v_cache, slots, start, length, 0.125), full)
    finally:
        torch.set_num_threads(with_threads)
    for m in range(1, 17):
        for lo in range(0, 48, m):
            hi = min(lo + m, 48)
            part = paged_attention(q[lo:hi], k_cache, v_cache, slots, start[lo:hi], length[lo:hi], 0.125)
            assert torch.equal(part, full[lo:hi]), (m, lo)


@needs_kernel
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("d", [64, 72, 80, 7])
def test_prefill_token_rows_equal_tokens_alone(variant: str, d: int) -> None:
    """A 130-token prefill (eight-key score blocks and a ragged tail; value lanes in blocks of 64, 32, 8 and
    one, head dims with and without a tail past the last 8 lanes) equals each token computed alone, bitwise."""
    q, k_cache, v_cache, (slots, start, length) = _case(8, 2, d, [130], [130], seed=d)
    full = paged_attention(q, k_cache, v_cache, slots, start, length, d**-0.5, variant=variant)
    for t in range(130):
        one = paged_attention(q[t:t + 1], k_cache, v_cache, slots, start[t:t + 1], length[t:t + 1], d**-0.5,
                              variant=variant)
        assert torch.equal(one, full[t:t + 1]), t
    assert_close(full, attention_reference(q, k_cache, v_cache, slots, start, length, d**-0.5))


@needs_kernel
def test_strided_query_heads_and_fallbacks() -> None:
    q, k_cache, v_cache, ctx = _case(4, 2, 32, [5], [9], seed=3)
    wide = torch.randn(5, 6, 32)
    wide[:, 1:5] = q  # q heads as a view of a wider projection
    assert torch.equal(
        paged_attention(wide[:, 1:5], k_cache, v_cache, *ctx, 0.2),
        paged_attention(q, k_cache, v_cache, *ctx, 0.2),
    )
    qb = q.bfloat16()
    assert not kernel_takes(qb, k_cache.bfloat16(), v_cache.bfloat16())
    out = paged_attention(qb, k_cache.bfloat16(), v_cache.bfloat16(), *ctx, 0.2)
    assert torch.equal(out, attention_reference(qb, k_cache.bfloat16(), v_cache.bfloat16(), *ctx, 0.2))
    qg = q.clone().requires_grad_()
    assert not kernel_takes(qg, k_cache, v_cache)
    paged_attention(qg, k_cache, v_cache, *ctx, 0.2).sum().backward()
    assert qg.grad is not None


@needs_kernel
@pytest.mark.parametrize("window", [None, 4])
def test_engine_attention_kernel_path_matches_its_torch_path(
    tiny_checkpoint, monkeypatch, window: int | None
) -> None:
    """The module's fp32 CPU path (the kernel) against its torch path (MOEGATE_DISABLE_CPP) on a chunk of a
    prefill beside a decode: the same cache writes, outputs within fp32 rounding."""
    from engine.config import ModelConfig, read_hf_config
    from engine.forward_batch import ForwardBatch
    from engine.models.attention import Attention

    cfg = ModelConfig.from_hf(read_hf_config(tiny_checkpoint()))
    attn = Attention(cfg)
    attn.sliding_window = window
    nh, kv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    batch = ForwardBatch(
        input_ids=torch.zeros(13, dtype=torch.long),
        positions=torch.cat([torch.arange(3, 15), torch.tensor([6])]),
        slot_mapping=torch.cat([torch.arange(3, 15), torch.tensor([36])]),
        query_lens=[12, 1],
        context_lens=[15, 7],
        context_slots=[torch.arange(15), torch.arange(30, 37)],
        logits_rows=torch.arange(13),
    )
    gen = torch.Generator().manual_seed(5)
    k_cache, v_cache = torch.randn(40, kv, d, generator=gen), torch.randn(40, kv, d, generator=gen)
    q, k, v = (torch.randn(13, h, d, generator=gen) for h in (nh, kv, kv))
    with torch.no_grad():
        caches = (k_cache.clone(), v_cache.clone())
        out = attn._attend_paged(q, k, v, batch, caches)
        monkeypatch.setenv("MOEGATE_DISABLE_CPP", "1")
        torch_caches = (k_cache.clone(), v_cache.clone())
        torch_out = attn._attend_paged(q, k, v, batch, torch_caches)
    assert torch.equal(caches[0], torch_caches[0]) and torch.equal(caches[1], torch_caches[1])
    assert_close(out, torch_out)
