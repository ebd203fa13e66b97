"""Causal grouped-query attention over a paged KV cache through the compiled kernel (`moegate_attention`,
csrc/attention.h: the one-call decode layer's attention), with the plain-torch reference. Each (token, head)
attends over its own context in a fixed order, so a token's bits never depend on the other tokens of the
call: prefill, decode and chunked prefill of one prompt give each token the same bytes."""

from __future__ import annotations

import torch


def attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    start: torch.Tensor,
    length: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """q [T, NH, D]; k_cache / v_cache [slots, KV, D]; token t attends over the cache rows
    slots[start[t] : start[t] + length[t]] (the last `window` of them where given) -> [T, NH, D] in q's dtype.
    Scores in q's dtype, softmax in fp32, as the engine's torch attention."""
    t_len, nh, d = q.shape
    nkv = k_cache.shape[1]
    out = torch.empty_like(q)
    for t in range(t_len):
        lo, n = int(start[t]), int(length[t])
        if window is not None and n > window:
            lo, n = lo + n - window, window
        rows = slots[lo : lo + n]
        k = k_cache.index_select(0, rows).to(q.dtype).transpose(0, 1)  # [KV, n, D]
        v = v_cache.index_select(0, rows).to(q.dtype).transpose(0, 1)
        qs = q[t].view(nkv, nh // nkv, d)  # [KV, G, D]
        probs = torch.softmax(
            torch.bmm(qs, k.transpose(1, 2)) * scale, dim=-1, dtype=torch.float32
        )  # [KV, G, n]
        out[t] = torch.bmm(probs.to(q.dtype), v).view(nh, d)
    return out


def kernel_takes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether `paged_attention` runs these tensors in the kernel: fp32 inference on CPU with contiguous
    caches and head rows."""
    if torch.is_grad_enabled() and q.requires_grad:
        return False
    return (
        q.dim() == 3
        and q.device.type == "cpu"
        and q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
        and q.stride(-1) == 1
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and k_cache.shape == v_cache.shape
        and k_cache.shape[-1] == q.shape[-1]
        and q.shape[1] % k_cache.shape[1] == 0
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    start: torch.Tensor,
    length: torch.Tensor,
    scale: float,
    window: int | None = None,
    variant: str | None = None,
) -> torch.Tensor:
    """`attention_reference`'s result through the kernel where it takes the tensors (`kernel_takes`; one
    call, fp32 softmax of each (token, head) in key order), else the reference. slots, start, length int64;
    variant: a compiled variant other than this machine's (tests)."""
    from kernels.fused_moe import kernel_library

    lib = kernel_library(variant) if kernel_takes(q, k_cache, v_cache) else None
    if lib is None or not hasattr(lib, "moegate_attention"):
        return attention_reference(q, k_cache, v_cache, slots, start, length, scale, window)
    t_len, nh, d = q.shape
    slots, start, length = (a.to(torch.int64).contiguous() for a in (slots, start, length))
    if not t_len == start.numel() == length.numel():
        raise ValueError(
            f"start and length need one entry per token: {t_len}, {start.numel()}, {length.numel()}"
        )
    out = torch.empty(t_len, nh, d)  # [T, NH, D]
    rc = lib.moegate_attention(
        q.data_ptr(),
        q.stride(0),
        q.stride(1),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        slots.data_ptr(),
        start.data_ptr(),
        length.data_ptr(),
        t_len,
        nh,
        k_cache.shape[1],
        d,
        window or 0,
        float(scale),
        out.data_ptr(),
        torch.get_num_threads(),  # the kernel runs a small job on this thread alone
    )
    if rc != 0:
        raise RuntimeError(f"moegate_attention failed with code {rc}")
    return out


def causal_contexts(
    query_lens: list[int], context_lens: list[int], context_slots: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each token's context for `paged_attention`: (slots, start, length), slots the sequences' context
    slots concatenated; token i of a chunk of q_len new tokens over ctx_len sees its sequence's first
    ctx_len - q_len + i + 1 slots (itself included)."""
    starts, lengths, offset = [], [], 0
    for q_len, ctx_len in zip(query_lens, context_lens, strict=True):
        starts.extend([offset] * q_len)
        lengths.extend(range(ctx_len - q_len + 1, ctx_len + 1))
        offset += ctx_len
    slots = (
        context_slots[0]
        if len(context_slots) == 1
        else torch.cat(context_slots)
        if context_slots
        else torch.empty(0, dtype=torch.long)
    )
    return (
        slots.to(torch.int64).contiguous(),
        torch.tensor(starts, dtype=torch.int64),
        torch.tensor(lengths, dtype=torch.int64),
    )
