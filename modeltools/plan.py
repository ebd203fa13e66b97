"""`moegate plan`: RAM, GPU memory and disk a model needs, and its predicted decode ceiling on this machine."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from engine.gguf import find_gguf
from kernels.formats import REGISTRY, formats_for
from modeltools.sizing import (
    EMBED,
    LM_HEAD,
    OTHER,
    PARTS,
    ROUTED,
    ModelShape,
    SizingError,
    Weight,
    census,
    expert_params,
    params_by_part,
    weights,
)

GIB = 2**30
DEFAULT_MODEL_DIR = Path(__file__).parent.parent / "engine" / "assets" / "demo-moe"
# Process overhead beside the weights (Python, torch, tokenizer, gateway; CUDA context + workspace).
# Estimates, printed on their own line, never mixed into the weight figures.
HOST_OVERHEAD_BYTES = int(1.5 * GIB)
# Temporaries of quantizing one weight (fp32 copy, padding, scaling, rounding, tiling), bytes per weight.
PACK_TEMP_BYTES = 24
GPU_OVERHEAD_BYTES = 1 * GIB


@dataclass(frozen=True)
class Precision:
    """A storage format: `bits` per weight plus, when grouped, one scale per `group_size` inputs."""

    name: str
    bits: int
    group_size: int = 0  # 0: plain floats, no scales
    scale_bytes: int = 4

    def matrix_bytes(self, rows: int, cols: int) -> int:
        weight = rows * cols * self.bits // 8
        if not self.group_size:
            return weight
        return weight + rows * math.ceil(cols / self.group_size) * self.scale_bytes


# As kernels/formats.py packs routed experts (its REGISTRY): one fp16 scale per output row and group of
# `group_size` inputs; tests/engine/test_engine_plan.py checks against the packed bytes. fp16 is a dense dtype only.
PRECISIONS = {name: Precision(name, REGISTRY[name].bits, REGISTRY[name].group_size, scale_bytes=2)
              for name in formats_for("experts")} | {"fp16": Precision("fp16", 16)}
EXPERT_PRECISIONS = tuple(sorted(formats_for("experts"), key=lambda name: REGISTRY[name].bits))  # int4 .. fp32
# Linear-attention models (Qwen3-Next): recurrent-state slots the engine allocates by default, one per running
# sequence (max_num_seqs 32) and as many prefix-cache snapshots (engine/recurrent_state.py); counted with the KV.
STATE_SLOTS = 64
DENSE_PRECISIONS = ("bf16", "fp16", "fp32")


@dataclass(frozen=True)
class PlanOptions:
    experts_precision: str = "int4"
    dense_precision: str = "bf16"  # dense part, hot experts and KV cache
    device: str = "cuda"  # where the dense part lives: "cuda" or "cpu"
    hot_experts: int = 0  # routed experts per MoE layer copied to the GPU
    kv_tokens: int = 32768  # KV cache capacity, all sequences together
    context_tokens: int = 0  # context whose KV each decoded token reads (for the ceiling)
    cache_gb: float = 10.0  # disk prefix-cache tier size, GiB
    # Execution mode's expert profile, resident beside the exploration one (`experts_precision`):
    # `execution_precision` on every MoE layer (None: the same as exploration) but the last
    # `formatting_layers`, which hold `formatting_precision`.
    execution_precision: str | None = None
    formatting_layers: int = 0
    formatting_precision: str = "bf16"
    load_workers: int = 4  # experts packed in parallel while loading (2 in flight per worker)

    def __post_init__(self) -> None:
        for name in ("experts_precision", "execution_precision", "formatting_precision"):
            value = getattr(self, name)
            if value is not None and value not in EXPERT_PRECISIONS:
                raise SizingError(f"{name.replace('_', ' ')} {value!r}: use one of {EXPERT_PRECISIONS}")
        if self.formatting_layers < 0 or self.load_workers < 1:
            raise SizingError("formatting layers must be >= 0 and load workers >= 1")
        if self.dense_precision not in DENSE_PRECISIONS:
            raise SizingError(f"dense precision {self.dense_precision!r}: use one of {DENSE_PRECISIONS}")
        if self.device not in ("cuda", "cpu"):
            raise SizingError(f"device {self.device!r}: use cuda or cpu")
        if min(self.hot_experts, self.kv_tokens, self.context_tokens) < 0 or self.cache_gb < 0:
            raise SizingError("hot experts, KV tokens, context tokens and cache size must be >= 0")
        if self.hot_experts and self.device == "cpu":
            raise SizingError("--hot-experts needs a GPU: hot experts are GPU copies (use --device cuda)")


@dataclass(frozen=True)
class Plan:
    model: str
    arch: str
    options: PlanOptions
    params: dict[str, int]  # part -> parameters
    bytes: dict[str, int]  # part -> bytes at the chosen precisions
    params_total: int
    params_active: int  # per decoded token
    dense_bytes: int  # everything but the routed experts
    experts_bytes: int  # all routed experts
    hot_experts_bytes: int
    kv_bytes_per_token: int
    kv_bytes: int
    fast_device_bytes: int  # GPU (device cuda) or 0
    host_ram_bytes: int
    checkpoint_disk_bytes: int
    cache_disk_bytes: int
    cache_tokens: int  # prefix tokens the disk tier holds
    streamed_bytes_per_token: int  # bytes read from memory per decoded token
    bandwidth_gbps: float  # host memory bandwidth used for the ceiling
    decode_ceiling_tok_s: float  # everything streamed from host memory at that bandwidth
    experts_ceiling_tok_s: float  # only the active routed experts from host memory (dense part on GPU)
    checkpoint_check: dict[str, object] = field(default_factory=dict)
    experts_by_mode: dict[str, int] = field(default_factory=dict)  # exploration / execution / resident (both)
    load_peak_bytes: int = 0  # host anonymous memory while loading: resident host weights + working set
    load_working_bytes: int = 0  # of which the bounded working set (tensors in flight), not process overhead
    state_bytes: int = 0  # linear-attention models: recurrent-state slots (STATE_SLOTS), where the KV cache is


def measure_bandwidth(total_mb: int = 256, repeats: int = 4) -> float:
    """Host memory bandwidth in GB/s: the lesser of a STREAM-like triad and a read-sum, best of `repeats`."""
    n = total_mb * 2**20 // (3 * 8)
    a, b, c = np.empty(n), np.full(n, 1.0), np.full(n, 2.0)  # [n] float64 each, ~total_mb together
    triad = read = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.multiply(c, 3.0, out=a)  # read c, write a
        np.add(a, b, out=a)  # read a, b, write a
        triad = min(triad, time.perf_counter() - t)
        t = time.perf_counter()
        float(b.sum()) + float(c.sum())
        read = min(read, time.perf_counter() - t)
    return min(5 * n * 8 / triad, 2 * n * 8 / read) / 1e9


def _routed_bytes(prec: Precision, w: Weight) -> int:
    """Packed bytes of routed-expert tensors: matrices in `prec`, biases (GPT-OSS) in fp32 as kernels/formats.py."""
    if len(w.shape) == 1:
        return w.shape[0] * 4 * w.count
    return prec.matrix_bytes(*w.shape) * w.count


def _part_bytes(shape: ModelShape, opts: PlanOptions) -> dict[str, int]:
    dense, experts = PRECISIONS[opts.dense_precision], PRECISIONS[opts.experts_precision]
    out = dict.fromkeys(PARTS, 0)
    for w in weights(shape):
        if w.part == ROUTED:
            out[w.part] += _routed_bytes(experts, w)
        else:
            out[w.part] += math.prod(w.shape) * dense.bits // 8 * w.count
    return out


def _expert_profiles(shape: ModelShape, opts: PlanOptions) -> dict[str, int]:
    """Routed-expert bytes of each mode's profile and of what stays resident (a profile both share counts once)."""
    per_layer = {fmt: sum(_routed_bytes(PRECISIONS[fmt], w) for w in weights(shape)
                          if w.part == ROUTED) // max(1, shape.num_moe_layers) for fmt in EXPERT_PRECISIONS}
    n = shape.num_moe_layers
    formatting = min(opts.formatting_layers, n)
    fast = opts.experts_precision
    execution = [opts.execution_precision or fast] * (n - formatting) + [opts.formatting_precision] * formatting
    exploration_bytes = n * per_layer[fast]
    execution_bytes = sum(per_layer[f] for f in execution)
    resident = exploration_bytes + sum(per_layer[f] for f in execution if f != fast)
    return {"exploration": exploration_bytes, "execution": execution_bytes, "resident": resident}


def _load_working_set(shape: ModelShape, opts: PlanOptions, experts_resident: int) -> int:
    """Host anonymous bytes in flight while streaming a checkpoint: the experts being packed (gate and up
    joined, cast to the model dtype, quantizer temporaries) and one layer's shard allocation. Dense
    tensors are read from the memory-mapped file (page cache, file-backed) straight into their
    parameter, so they add nothing beyond the parameter itself."""
    ckpt_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}.get(shape.checkpoint_dtype, 2)
    dense_bytes = PRECISIONS[opts.dense_precision].bits // 8
    in_flight = 2 * opts.load_workers * expert_params(shape) * (ckpt_bytes + dense_bytes + PACK_TEMP_BYTES)
    return in_flight + experts_resident // max(1, shape.num_moe_layers)


def _checkpoint_check(shape: ModelShape, model_dir: Path) -> tuple[dict[str, object], int]:
    """Compare config-derived counts with the safetensors headers (or a GGUF's tensor index); returns (report,
    bytes on disk)."""
    found = census(model_dir)
    expected = params_by_part(shape)
    if found is None:
        nbytes = {"float32": 4, "bfloat16": 2, "float16": 2}.get(shape.checkpoint_dtype, 2)
        return {"headers": False}, sum(expected.values()) * nbytes
    mismatches = {p: {"config": expected.get(p, 0), "checkpoint": found.params[p]}
                  for p in (*PARTS, OTHER) if expected.get(p, 0) != found.params[p]}
    report = {"headers": True, "source": "gguf" if find_gguf(model_dir) else "safetensors",
              "tensors": found.num_tensors, "match": not mismatches,
              "params_checkpoint": sum(found.params.values()), "mismatches": mismatches}
    return report, found.file_bytes


def build_plan(model_dir: str | Path, opts: PlanOptions, bandwidth_gbps: float) -> Plan:
    model_dir = Path(model_dir)
    shape = ModelShape.from_dir(model_dir)
    params = params_by_part(shape)
    nbytes = _part_bytes(shape, opts)
    dense_prec = PRECISIONS[opts.dense_precision]
    per_expert = expert_params(shape)
    n_moe = shape.num_moe_layers
    params_total = sum(params.values())
    params_active = params_total - params[ROUTED] + shape.top_k * per_expert * n_moe

    dense_bytes = sum(b for p, b in nbytes.items() if p != ROUTED)
    experts_bytes = nbytes[ROUTED]
    one_expert = nbytes[ROUTED] // max(1, shape.num_experts * n_moe)
    hot = min(opts.hot_experts, shape.num_experts)
    hot_bytes = hot * n_moe * per_expert * dense_prec.bits // 8
    kv_per_token = shape.kv_bytes_per_token(dense_prec.bits)
    kv_bytes = kv_per_token * opts.kv_tokens
    state_bytes = shape.state_bytes_per_sequence * STATE_SLOTS
    profiles = _expert_profiles(shape, opts)
    resident = profiles["resident"]
    if opts.device == "cuda":
        fast, host = dense_bytes + hot_bytes + kv_bytes + state_bytes, resident
    else:
        fast, host = 0, dense_bytes + resident + kv_bytes + state_bytes
    working = _load_working_set(shape, opts, resident)
    load_peak = resident + (dense_bytes if opts.device == "cpu" else 0) + working

    # Per decoded token: every dense weight but the embedding table (one row), the LM head even when tied,
    # the top-k experts of every MoE layer, and the KV of the context.
    lm_head = shape.vocab_size * shape.hidden_size * dense_prec.bits // 8
    dense_streamed = dense_bytes - nbytes[EMBED] - nbytes[LM_HEAD] + lm_head
    dense_streamed += shape.hidden_size * dense_prec.bits // 8
    active_experts = shape.top_k * n_moe * one_expert
    streamed = dense_streamed + active_experts + kv_per_token * opts.context_tokens + shape.state_bytes_per_sequence
    check, disk = _checkpoint_check(shape, model_dir)
    cache_bytes = int(opts.cache_gb * GIB)
    return Plan(
        model=str(model_dir), arch=shape.arch, options=opts, params=params, bytes=nbytes,
        params_total=params_total, params_active=params_active, dense_bytes=dense_bytes,
        experts_bytes=experts_bytes, hot_experts_bytes=hot_bytes, kv_bytes_per_token=kv_per_token,
        kv_bytes=kv_bytes, fast_device_bytes=fast, host_ram_bytes=host, checkpoint_disk_bytes=disk,
        cache_disk_bytes=cache_bytes, cache_tokens=cache_bytes // kv_per_token,
        streamed_bytes_per_token=streamed, bandwidth_gbps=bandwidth_gbps,
        decode_ceiling_tok_s=bandwidth_gbps * 1e9 / streamed,
        experts_ceiling_tok_s=bandwidth_gbps * 1e9 / active_experts,
        checkpoint_check=check, experts_by_mode=profiles, load_peak_bytes=load_peak, load_working_bytes=working,
        state_bytes=state_bytes,
    )


def _gib(n: float) -> str:
    return f"{n / GIB:8.2f} GiB"


def format_plan(plan: Plan) -> str:
    o = plan.options
    lines = [
        f"model {plan.model} ({plan.arch}): {plan.params_total / 1e9:.3f} B params, "
        f"{plan.params_active / 1e9:.3f} B active per token",
        f"precision: routed experts {o.experts_precision}, dense part + KV {o.dense_precision}; "
        f"dense part on {o.device}",
        "",
        f"{'part':<16}{'params':>16}{'bytes':>14}",
    ]
    for part in PARTS:
        if plan.params[part]:
            lines.append(f"{part:<16}{plan.params[part]:>16,}{_gib(plan.bytes[part]):>14}")
    kv = f"KV cache ({o.kv_tokens:,} tokens x {plan.kv_bytes_per_token:,} B)"
    lines += ["", f"{kv:<44}{_gib(plan.kv_bytes)}"]
    if plan.state_bytes:
        state = f"recurrent state ({STATE_SLOTS} slots x {plan.state_bytes // STATE_SLOTS:,} B)"
        lines.append(f"{state:<44}{_gib(plan.state_bytes)}   (linear-attention layers: running + prefix snapshots)")
    if o.device == "cuda":
        lines += [
            f"{'GPU: dense part + KV + hot experts':<44}{_gib(plan.fast_device_bytes)}"
            f"   (+ ~{GPU_OVERHEAD_BYTES / GIB:.1f} GiB CUDA context/workspace)",
        ]
        if o.hot_experts:
            lines.append(f"{f'  of which hot experts ({o.hot_experts}/layer, {o.dense_precision})':<44}"
                         f"{_gib(plan.hot_experts_bytes)}")
    modes = plan.experts_by_mode
    if modes["execution"] != modes["exploration"] or modes["resident"] != modes["exploration"]:
        fmt = o.execution_precision or o.experts_precision
        what = f"{fmt}" + (f", last {o.formatting_layers} MoE layers {o.formatting_precision}"
                           if o.formatting_layers else "")
        lines += [
            f"{'routed experts, exploration (' + o.experts_precision + ')':<44}{_gib(modes['exploration'])}",
            f"{'routed experts, execution (' + what + ')':<44}{_gib(modes['execution'])}",
            f"{'routed experts resident (both profiles)':<44}{_gib(modes['resident'])}",
        ]
    host_what = "routed experts" if o.device == "cuda" else "all weights + KV"
    lines += [
        f"{'RAM: ' + host_what:<44}{_gib(plan.host_ram_bytes)}"
        f"   (+ ~{HOST_OVERHEAD_BYTES / GIB:.1f} GiB process overhead)",
        f"{'RAM peak while loading (anonymous)':<44}{_gib(plan.load_peak_bytes)}"
        f"   (streamed; of which {plan.load_working_bytes / GIB:.2f} GiB in flight; + process overhead)",
        f"{'disk: checkpoint':<44}{_gib(plan.checkpoint_disk_bytes)}",
        f"{'disk: prefix-cache tier':<44}{_gib(plan.cache_disk_bytes)}   ({plan.cache_tokens:,} tokens of KV)",
        "",
        f"streamed per decoded token: {plan.streamed_bytes_per_token / 2**20:.1f} MiB "
        f"(context {o.context_tokens:,} tokens); host bandwidth {plan.bandwidth_gbps:.1f} GB/s",
        f"decode ceiling, everything from host memory: {plan.decode_ceiling_tok_s:8.1f} tok/s",
        f"decode ceiling, active experts from host memory only: {plan.experts_ceiling_tok_s:8.1f} tok/s "
        "(dense part on GPU)",
    ]
    check = plan.checkpoint_check
    if not check.get("headers"):
        lines.append("checkpoint: no safetensors or GGUF found; disk size estimated from config dtype")
    elif check["match"]:
        where = "the GGUF tensor index" if check["source"] == "gguf" else "safetensors headers"
        lines.append(f"checkpoint: {check['tensors']} tensors in {where} match the config counts")
    else:
        lines.append(f"checkpoint: tensors DISAGREE with the config: {check['mismatches']}")
    return "\n".join(lines)


def _default_device() -> str:
    wanted = os.environ.get("MOEGATE_DEVICE", "auto")
    if wanted in ("cpu", "cuda"):
        return wanted
    try:
        import torch
    except ImportError:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def run(args: argparse.Namespace) -> int:
    model = args.model or os.environ.get("MOEGATE_MODEL") or str(DEFAULT_MODEL_DIR)
    try:
        opts = PlanOptions(
            experts_precision=args.experts_precision, dense_precision=args.dense_precision,
            device=args.device if args.device != "auto" else _default_device(),
            hot_experts=args.hot_experts, kv_tokens=args.kv_tokens, context_tokens=args.context_tokens,
            cache_gb=args.cache_gb, execution_precision=args.execution_precision,
            formatting_layers=args.formatting_layers, formatting_precision=args.formatting_precision,
        )
        bandwidth = args.bandwidth if args.bandwidth else measure_bandwidth()
        plan = build_plan(model, opts, bandwidth)
    except SizingError as exc:
        print(f"moegate plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(asdict(plan), indent=2))
    else:
        print(format_plan(plan))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plan", help="memory, disk and decode-ceiling plan for a model",
                              description=__doc__)
    p.add_argument("--model", help="checkpoint dir (config.json [+ safetensors]); default $MOEGATE_MODEL "
                   "or the bundled demo model")
    p.add_argument("--experts-precision", choices=EXPERT_PRECISIONS, default="int4")
    p.add_argument("--execution-precision", choices=EXPERT_PRECISIONS,
                   help="routed experts in execution mode, resident beside the exploration ones "
                   "(default: the same as --experts-precision, nothing extra)")
    p.add_argument("--formatting-layers", type=int, default=0,
                   help="last N MoE layers hold --formatting-precision in execution mode")
    p.add_argument("--formatting-precision", choices=EXPERT_PRECISIONS, default="bf16")
    p.add_argument("--dense-precision", choices=DENSE_PRECISIONS, default="bf16",
                   help="dense part, hot experts and KV cache")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the dense part goes (auto: $MOEGATE_DEVICE, else CUDA if available)")
    p.add_argument("--hot-experts", type=int, default=0, help="experts per MoE layer copied to the GPU")
    p.add_argument("--kv-tokens", type=int, default=32768, help="KV cache capacity in tokens")
    p.add_argument("--context-tokens", type=int, default=0,
                   help="context length whose KV each decoded token reads (for the ceiling)")
    p.add_argument("--cache-gb", type=float, default=10.0, help="disk prefix-cache tier size in GiB")
    p.add_argument("--bandwidth", type=float, default=0.0,
                   help="host memory bandwidth in GB/s (default: measure it, ~1 s)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)
