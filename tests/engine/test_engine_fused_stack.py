"""The decoder stack in one kernel call (engine/models/fused_decode.py `FusedStack`, `moegate_decode_stack`)
against its reference, the layers called one by one (`FusedDecodeLayer`, each `moegate_decode_layer`) followed
by the row-wise final norm: the same hidden bits, KV-cache bytes and routing counts, in both profiles."""

from __future__ import annotations

import pytest
import torch

from engine.experts import PlacementConfig
from engine.forward_batch import ForwardBatch
from engine.llm_engine import LLM
from engine.models.fused_decode import FusedContext, FusedStack
from kernels.bindings import DecodeSlotsError
from kernels.norm import rms_norm_rows


@pytest.fixture(scope="module")
def engine(hf_checkpoint):
    ckpt = hf_checkpoint("qwen3_moe", num_experts_per_tok=4, num_hidden_layers=3, max_position_embeddings=1024)
    placement = PlacementConfig(fast_format="int4", exact_format="bf16")
    llm = LLM(ckpt, placement=placement, num_kv_blocks=64, block_size=8, fast_dense="int8", fast_lm_head="int8",
              progress=False)
    return llm.engine


def _batch(exact: bool) -> ForwardBatch:
    """Two sequences: a 5-token prefill chunk after 3 cached tokens, and a decode after 17."""
    gen = torch.Generator().manual_seed(1)
    a = ForwardBatch.single(torch.randint(1, 500, (5,), generator=gen).tolist(), [3, 4], 8, start=3)
    b = ForwardBatch.single(torch.randint(1, 500, (1,), generator=gen).tolist(), [9, 10, 11], 8, start=17)
    return ForwardBatch(
        input_ids=torch.cat([a.input_ids, b.input_ids]), positions=torch.cat([a.positions, b.positions]),
        slot_mapping=torch.cat([a.slot_mapping, b.slot_mapping]), query_lens=[5, 1], context_lens=[8, 18],
        context_slots=[*a.context_slots, *b.context_slots], logits_rows=torch.tensor([4, 5]), exact=exact)


@pytest.mark.parametrize("exact", [False, True], ids=["exploration", "execution"])
def test_stack_call_equals_the_layers_one_by_one(engine, exact):
    model, caches = engine.runner.model, engine.runner.layer_caches
    stack = model.exact_layers if exact else model.fused_layers
    assert isinstance(stack, FusedStack) and len(stack) == model.config.num_layers
    for k, v in caches:  # context the new tokens attend to
        k.copy_(torch.randn(k.shape, generator=torch.Generator().manual_seed(2)))
        v.copy_(torch.randn(v.shape, generator=torch.Generator().manual_seed(3)))
    batch = _batch(exact)
    with torch.inference_mode():
        x = model.model.embed_tokens(batch.input_ids).contiguous()  # [T, H]
        cos, sin = model.model.layers[0].self_attn._rope(batch, torch.float32)
        ctx = FusedContext(batch, cos, sin)
        counts = [f.packed.counts for f in stack.layers]
        start = [c.clone() for c in counts]
        ref_caches = [(k.clone(), v.clone()) for k, v in caches]
        ref = x.clone()
        for f, (k, v) in zip(stack.layers, ref_caches, strict=True):
            f(ref, ctx, k, v)
        ref = rms_norm_rows(ref, model.model.norm.weight, model.model.norm.eps)
        ref_counts = [c - s for c, s in zip(counts, start, strict=True)]
        mid = [c.clone() for c in counts]
        got = stack(x.clone(), ctx, caches, (model.model.norm.weight, model.model.norm.eps))
        got_counts = [c - m for c, m in zip(counts, mid, strict=True)]
    assert torch.equal(got, ref)
    for (k, v), (rk, rv) in zip(caches, ref_caches, strict=True):
        assert torch.equal(k, rk) and torch.equal(v, rv)
    for g, r in zip(got_counts, ref_counts, strict=True):
        assert torch.equal(g, r) and int(g.sum()) == batch.num_tokens * model.config.top_k


def test_stack_without_the_norm_returns_the_layers_output(engine):
    """norm=None: x is updated in place and returned un-normed (the module's norm then runs after it)."""
    model, caches = engine.runner.model, engine.runner.layer_caches
    norm = (model.model.norm.weight, model.model.norm.eps)
    batch = _batch(False)
    with torch.inference_mode():
        emb = model.model.embed_tokens(batch.input_ids).contiguous()  # [T, H]
        cos, sin = model.model.layers[0].self_attn._rope(batch, torch.float32)
        ctx = FusedContext(batch, cos, sin)
        normed = model.fused_layers(emb.clone(), ctx, caches, norm)
        plain_in = emb.clone()
        plain = model.fused_layers(plain_in, ctx, caches)  # the same tokens again: the same KV rewritten
        assert plain is plain_in
        assert torch.equal(rms_norm_rows(plain, *norm), normed)


def test_prefill_through_the_stack_equals_the_modules(engine):
    """A 40-token exploration prefill (above the decode step's rows) runs the fused stack (`MoeForCausalLM._fused`):
    its hidden states and KV bytes equal the torch modules' layer by layer (the same kernels on the same inputs)."""
    model, caches = engine.runner.model, engine.runner.layer_caches
    gen = torch.Generator().manual_seed(4)
    batch = ForwardBatch.single(torch.randint(1, 500, (40,), generator=gen).tolist(), list(range(6)), 8)
    stack = model.fused_layers
    assert model._fused(batch, torch.zeros(1))
    out = {}
    with torch.inference_mode():
        for fused in (True, False):
            model.fused_layers = stack if fused else None
            try:
                hidden = model(batch, caches)
            finally:
                model.fused_layers = stack
            out[fused] = (hidden.clone(), [(k.clone(), v.clone()) for k, v in caches])
    assert torch.equal(out[True][0], out[False][0])
    for (k, v), (rk, rv) in zip(out[True][1], out[False][1], strict=True):
        assert torch.equal(k, rk) and torch.equal(v, rv)


@pytest.mark.parametrize("bad", ["new_slot", "negative_slot", "context_slot", "context_range", "negative_start"])
def test_bad_slots_raise_and_write_nothing(engine, bad):
    """A slot id outside the KV cache, or a context range outside the context slots, raises DecodeSlotsError from
    the stack's call and from a layer's, before anything is written (no out-of-bounds write or read)."""
    model, caches = engine.runner.model, engine.runner.layer_caches
    cache_slots = caches[0][0].numel() // (model.config.num_kv_heads * model.config.head_dim)
    batch = _batch(False)
    with torch.inference_mode():
        x = model.model.embed_tokens(batch.input_ids).contiguous()  # [T, H]
        cos, sin = model.model.layers[0].self_attn._rope(batch, torch.float32)
        ctx = FusedContext(batch, cos, sin)
        if bad == "new_slot":
            ctx.slot_mapping[-1] = cache_slots
        elif bad == "negative_slot":
            ctx.slot_mapping[0] = -1
        elif bad == "context_slot":
            ctx.slots[-1] = 10**9
        elif bad == "context_range":
            ctx.length[-1] = ctx.slots.numel() - ctx.start[-1] + 1
        else:
            ctx.start[0] = -1
        before = [(k.clone(), v.clone()) for k, v in caches]
        for call in (lambda: model.fused_layers(x.clone(), ctx, caches),
                     lambda: model.fused_layers.layers[0](x.clone(), ctx, *caches[0])):
            with pytest.raises(DecodeSlotsError, match="bad block table"):
                call()
        for (k, v), (rk, rv) in zip(caches, before, strict=True):
            assert torch.equal(k, rk) and torch.equal(v, rv)
        model.fused_layers(x.clone(), FusedContext(_batch(False), cos, sin), caches)  # a good table still runs
