"""Top-k routing through the compiled kernel (`moegate_router`, csrc/router.h: the one-call decode layer's
router), with the plain-torch reference. Each row is routed alone in a fixed order, so a token's weights and
expert ids never depend on the other rows of the call.

Kinds: "softmax" (top-k of the fp32 softmax of the logits, optionally renormalised: Qwen-MoE, OLMoE) and
"topk_softmax" (GPT-OSS: logits with a bias, softmax over the top-k logits). DeepSeek's grouped routers stay
in torch (engine.models.moe.Router).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

KINDS = {"softmax": 0, "topk_softmax": 1}  # the kernel's RouterKind codes


def router_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, kind: str, norm_topk: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H], weight [E, H] (bias [E]) -> (logits [T, E], top-k weights [T, K], top-k ids [T, K]), weights
    descending, in the logits' dtype."""
    logits = F.linear(x, weight, bias)  # [T, E]
    if kind == "topk_softmax":
        top, ids = torch.topk(logits, top_k, dim=-1)  # [T, K] descending
        return logits, torch.softmax(top, dim=-1, dtype=top.dtype), ids
    if kind != "softmax":
        raise ValueError(f"unknown router kind {kind!r}; expected one of {sorted(KINDS)}")
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, K]
    if norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return logits, weights.to(logits.dtype), ids


def kernel_takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `route` runs these tensors in the kernel: fp32 inference on CPU."""
    params = (weight,) if bias is None else (weight, bias)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, *params)):
        return False
    return (
        x.dim() == 2
        and x.device.type == "cpu"
        and all(t.device.type == "cpu" for t in params)
        and x.dtype == torch.float32
        and all(t.dtype == torch.float32 for t in params)
    )


def route(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    kind: str,
    norm_topk: bool,
    variant: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`router_reference`'s result through the kernel where it takes the tensors (`kernel_takes`), else the
    reference. The kernel breaks ties towards the lower expert id. variant: a compiled variant other than
    this machine's (tests)."""
    from kernels.fused_moe import kernel_library

    lib = kernel_library(variant) if kind in KINDS and kernel_takes(x, weight, bias) else None
    if lib is None or not hasattr(lib, "moegate_router"):
        return router_reference(x, weight, bias, top_k, kind, norm_topk)
    t, h = x.shape
    e = weight.shape[0]
    if weight.shape != (e, h) or (bias is not None and bias.shape != (e,)) or not 1 <= top_k <= e:
        raise ValueError(f"router: x {tuple(x.shape)}, weight {tuple(weight.shape)}, top_k {top_k}")
    x, weight = x.contiguous(), weight.detach().contiguous()
    bias = None if bias is None else bias.detach().contiguous()
    logits, weights = torch.empty(t, e), torch.empty(t, top_k)  # [T, E], [T, K]
    ids = torch.empty(t, top_k, dtype=torch.int64)
    rc = lib.moegate_router(
        x.data_ptr(),
        weight.data_ptr(),
        None if bias is None else bias.data_ptr(),
        t,
        h,
        e,
        top_k,
        KINDS[kind],
        int(norm_topk),
        logits.data_ptr(),
        weights.data_ptr(),
        ids.data_ptr(),
        torch.get_num_threads(),  # the kernel runs a small job on this thread alone
    )
    if rc != 0:
        raise RuntimeError(f"moegate_router failed with code {rc}")
    return logits, weights, ids
