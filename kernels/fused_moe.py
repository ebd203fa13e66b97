"""Fused routed-expert MoE on CPU (compiled kernel) and its plain-torch reference.

T = tokens, k = experts per token, H = hidden, I = expert intermediate.
out[t] = sum over slots s (in slot order) of w[t, s] * down(act(gate(x[t]), up(x[t]))) for expert
topk_ids[t, s]; a slot with id -1 is skipped. Tokens sharing an expert read its weights once. `act` and the
optional per-expert biases (added to gate/up before act, to down before w) come with the PackedExperts
(kernels/formats.py: SiLU, or GPT-OSS's clamped SwiGLU).

Tolerance vs the reference (tests/kernels): fp32 / bf16 / int8 multiply by exactly the dequantized
weights the reference uses and only the fp32 summation order differs (bf16_a16: the reference rounds
both projections' inputs to bf16 as the kernel does; vdpbf16ps and AMX tdpbf16ps round their sums their own
ways); int4 formats are W4A8 (both projections' inputs quantized per token and group to int8; int8_a8 the same,
W8A8) and their reference (kernels/w4a8.py) replays the kernel's arithmetic, so they agree to the last bit but
for ~2^-29-rare double roundings.
|kernel - reference| <= 1e-4 * max|reference| + 1e-5 for every format.
Determinism: a row's output is bitwise identical whatever else is in the batch, for any thread count.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os

import torch

from kernels import build
from kernels.cpu_features import detect, select_variant
from kernels.formats import FORMAT_CODE, REGISTRY, PackedExperts, quantize_activations, round_activations
from kernels.w4a8 import w4a8_moe

log = logging.getLogger(__name__)


class ExpertIdError(ValueError):
    """topk_ids names an expert the PackedExperts does not hold."""


def cpp_disabled() -> bool:
    return os.environ.get("MOEGATE_DISABLE_CPP", "") not in ("", "0")


@functools.cache
def _detected_variant() -> str:
    return select_variant(detect())


def kernel_variant() -> str:
    """The compiled variant this machine runs ($MOEGATE_KERNEL_VARIANT overrides detection)."""
    return os.environ.get("MOEGATE_KERNEL_VARIANT") or _detected_variant()


def kernel_library(variant: str | None = None):
    """The loaded compiled kernel library (a ctypes.CDLL), or None: MOEGATE_DISABLE_CPP is set or it
    cannot be built (the caller falls back to its torch reference). The environment is read at every call (a
    variable set later counts); the machine's detection is cached, and a loaded library is one dict lookup."""
    return None if cpp_disabled() else build.load(variant or kernel_variant())


def kernel_available(variant: str | None = None) -> bool:
    return kernel_library(variant) is not None


@contextlib.contextmanager
def path_limit(name: str):
    """Within the block, the loaded kernel libraries use no instruction path wider than `name` ("amx": all
    the CPU has, "bf16": no AMX, "zmm": neither AMX nor vdpbf16ps), so tests and benchmarks can force each
    narrower path on a machine that has the wider ones (every library loaded so far). Process-wide: not for use beside other kernel
    calls on other threads."""
    level = build.PATH_LEVELS[name]
    kernel_library()  # this machine's variant loaded, so the limit reaches it
    libs = [lib for lib in build.loaded() if hasattr(lib, "moegate_path_limit")]
    before = [lib.moegate_path_limit(level) for lib in libs]
    try:
        yield
    finally:
        for lib, old in zip(libs, before, strict=True):
            lib.moegate_path_limit(old)


def backend_summary() -> str:
    """One line for the startup log: which path fused_moe takes on this machine."""
    if cpp_disabled():
        return "CPU MoE kernel: torch reference (MOEGATE_DISABLE_CPP set)"
    variant = kernel_variant()
    lib = build.load(variant)
    path = f"compiled {variant} ({lib.moegate_simd_path().decode()})" if lib is not None else \
        "torch reference (build failed)"
    return f"CPU MoE kernel: {path}; cpu {detect().summary()}; {torch.get_num_threads()} threads"


def _local_ids(topk_ids: torch.Tensor, experts: PackedExperts, skip_missing: bool) -> torch.Tensor:
    """Global expert ids [T, k] -> local indices into ``experts`` (-1 = skip)."""
    ids = topk_ids.to(torch.int64)
    n = experts.num_experts
    if experts.expert_ids == tuple(range(n)):
        if not skip_missing:
            return ids
        return torch.where(ids < n, ids, -1)
    top = max(max(experts.expert_ids), int(ids.max()) if ids.numel() else 0) + 1
    lut = torch.full((top + 1,), -1, dtype=torch.int64)
    lut[torch.tensor(experts.expert_ids)] = torch.arange(n)
    local = lut[ids.clamp(min=-1)]  # -1 indexes the last entry, which stays -1
    if not skip_missing and bool(((local < 0) & (ids >= 0)).any()):
        missing = sorted(set(ids[(local < 0) & (ids >= 0)].tolist()))
        raise ExpertIdError(f"experts {missing} are not held by this PackedExperts (holds "
                            f"{len(experts.expert_ids)}); pass skip_missing=True to skip them")
    return local


def _check(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: PackedExperts,
           act: str | None) -> None:
    if act is not None and act != experts.act.kind:
        raise ValueError(f"activation {act!r} requested but these experts were packed with {experts.act.kind!r}")
    if x.dim() != 2 or x.shape[1] != experts.hidden:
        raise ValueError(f"x must be [T, {experts.hidden}], got {tuple(x.shape)}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
                         f"must both be [T={x.shape[0]}, k]")


def fused_moe_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        experts: PackedExperts, act: str | None = None, *, skip_missing: bool = False) -> torch.Tensor:
    """Plain torch: dequantize each used expert, matmul in fp32. Works on any device. -> [T, H] fp32."""
    _check(x, topk_ids, topk_weights, experts, act)
    x = x.float()  # [T, H]
    local = _local_ids(topk_ids.cpu(), experts, skip_missing).to(x.device)  # [T, k]
    if bool((local >= experts.num_experts).any()) or bool((local < -1).any()):
        raise ExpertIdError(f"topk_ids must lie in [-1, {experts.num_experts}) for this PackedExperts")
    w = topk_weights.float()
    if REGISTRY[experts.fmt].a8:  # W4A8 / W8A8: the kernel's integer + fp32 arithmetic, step by step
        return w4a8_moe(x.cpu(), local.cpu(), w.cpu(), experts.to("cpu")).to(x.device)
    out = torch.zeros_like(x)
    inter, fmt = experts.intermediate, experts.fmt
    xa = round_activations(x, fmt)  # [T, H]: bf16_a16 multiplies bf16-rounded activations
    for e in torch.unique(local[local >= 0]).tolist():
        tok, slot = (local == e).nonzero(as_tuple=True)
        w_gu, w_dn = (t.to(x.device) for t in experts.dequantize(e))  # [2I, H], [H, I]
        b_gu, b_dn = _biases(experts, e, x.device)
        gu = xa[tok] @ w_gu.T + b_gu  # [n, 2I]
        h = round_activations(experts.act(gu[:, :inter], gu[:, inter:]), fmt)  # [n, I]
        out.index_add_(0, tok, (h @ w_dn.T + b_dn) * w[tok, slot, None])  # [n, H]
    return out


def _biases(experts: PackedExperts, e: int, device: torch.device) -> tuple[torch.Tensor | float, torch.Tensor | float]:
    """Local expert e's (gate_up bias [2I], down bias [H]) on `device`, or zeros as scalars."""
    b = experts.biases(e)
    return (0.0, 0.0) if b is None else (b[0].to(device), b[1].to(device))


def fused_moe_fake_quant(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                         experts: PackedExperts) -> torch.Tensor:
    """int4 semantics without the kernel's summation order: dequantized weights times int8-quantized
    inputs of both projections (``quantize_activations``), fp32 matmuls. Differs from the kernel by
    fp32 rounding and, rarely, by one int8 step of an intermediate activation."""
    x = x.float()  # [T, H]
    local = _local_ids(topk_ids.cpu(), experts, False)
    out = torch.zeros_like(x)
    inter, gs = experts.intermediate, experts.group_size
    xq = quantize_activations(x, gs)
    for e in torch.unique(local[local >= 0]).tolist():
        tok, slot = (local == e).nonzero(as_tuple=True)
        w_gu, w_dn = experts.dequantize(e)  # [2I, H], [H, I]
        b_gu, b_dn = _biases(experts, e, x.device)
        gu = xq[tok] @ w_gu.T + b_gu  # [n, 2I]
        h = quantize_activations(experts.act(gu[:, :inter], gu[:, inter:]), gs)  # [n, I]
        out.index_add_(0, tok, (h @ w_dn.T + b_dn) * topk_weights.float()[tok, slot, None])
    return out


def fused_moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, experts: PackedExperts,
              act: str | None = None, *, skip_missing: bool = False, use_cpp: bool | None = None,
              variant: str | None = None, num_threads: int | None = None) -> torch.Tensor:
    """Routed-expert MoE: x [T, H] fp32/bf16, topk_ids [T, k] (-1 = skip), topk_weights [T, k] -> [T, H] fp32.

    ``num_threads`` defaults to torch's thread count: the most the kernel's pool uses (one thread for a job
    streaming under 1 MiB: kernels/csrc/work_pool.h).
    ``use_cpp=False`` (or MOEGATE_DISABLE_CPP=1) runs the torch reference; so does a failed build
    (after one logged warning) and non-CPU tensors. ``skip_missing`` treats ids the PackedExperts
    does not hold as -1 (for a subset of experts placed on this device).
    """
    _check(x, topk_ids, topk_weights, experts, act)
    lib = kernel_library(variant) if use_cpp is not False and x.device.type == "cpu" else None
    if lib is None or experts.tensors["gate_up"].device.type != "cpu":
        return fused_moe_reference(x, topk_ids, topk_weights, experts, act, skip_missing=skip_missing)
    ids = _local_ids(topk_ids, experts, skip_missing)  # [T, k]
    return run_kernel(lib, x, ids, topk_weights, experts, num_threads)


def run_kernel(lib, x: torch.Tensor, local_ids: torch.Tensor, topk_weights: torch.Tensor, experts: PackedExperts,
               num_threads: int | None = None) -> torch.Tensor:
    """One call of ``lib``'s moegate_fused_moe (checked arguments, local expert ids) -> [T, H] fp32."""
    xf = x.float().contiguous()  # [T, H]
    ids = local_ids.to(torch.int64).contiguous()  # [T, k]
    wts = topk_weights.float().contiguous()  # [T, k]
    t, k = ids.shape
    h = experts.hidden
    ldo = (h + 7) // 8 * 8
    out = torch.empty(t, ldo, dtype=torch.float32)  # [T, H8*8]
    tens = experts.tensors
    ptr = [tens[n].data_ptr() if n in tens and tens[n].numel() else None for n in
           ("gate_up", "gate_up_scales", "gate_up_mins", "down", "down_scales", "down_mins", "gate_up_bias",
            "down_bias")]
    act = experts.act
    rc = lib.moegate_fused_moe(xf.data_ptr(), ids.data_ptr(), wts.data_ptr(), out.data_ptr(), t, k,
                               FORMAT_CODE[experts.fmt], experts.num_experts, h, experts.intermediate,
                               experts.group_size, ptr[0], ptr[1], ptr[2], ptr[3], ptr[4], ptr[5],
                               ctypes.c_int(num_threads or torch.get_num_threads()), ptr[6], ptr[7],
                               act.code, ctypes.c_float(act.alpha), ctypes.c_float(act.limit))
    if rc == -1:
        raise ExpertIdError(f"topk_ids must lie in [-1, {experts.num_experts}) for this PackedExperts")
    if rc != 0:
        raise RuntimeError(f"moegate_fused_moe failed with code {rc} for format {experts.fmt}")
    return out if ldo == h else out[:, :h].contiguous()
