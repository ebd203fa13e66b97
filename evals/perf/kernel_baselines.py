"""What the kernel benchmark (kernel_bench.py) runs beside this checkout's kernel: routed MoE through per-expert
torch ops (the torch baselines, per matching format), and another git revision's compiled kernel (its source,
its formats, the SIMD path it reports)."""

from __future__ import annotations

import ast
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels import build

# the torch baseline each format is compared with
TORCH_KIND = {"bf16": "bf16", "int8": "int8", "int4": "int4", "int4_asym": "int4", "fp32": "fp32", "bf16_a16": "bf16",
              "int8_a8": "int8"}


def torch_layers(w_gu: torch.Tensor, w_dn: torch.Tensor, kind: str) -> tuple[list, int]:
    """Per-expert weights for a torch baseline, and bytes per expert."""
    experts = []
    for e in range(w_gu.shape[0]):
        if kind == "fp32":
            experts.append((w_gu[e].contiguous(), w_dn[e].contiguous()))
        elif kind == "bf16":
            experts.append((w_gu[e].to(torch.bfloat16), w_dn[e].to(torch.bfloat16)))
        elif kind == "int8":
            pair = []
            for w in (w_gu[e], w_dn[e]):
                s = w.abs().amax(1) / 127
                pair.append(((w / s[:, None]).round().to(torch.int8), s.to(torch.bfloat16)))
            experts.append(tuple(pair))
        else:  # int4, group 32, asymmetric scale+zero as torch expects
            pair = []
            for w in (w_gu[e], w_dn[e]):
                n, k = w.shape
                q = torch.randint(0, 16, (n, k), dtype=torch.int32)
                sz = torch.randn(k // 32, n, 2).to(torch.bfloat16)
                pair.append((torch._convert_weight_to_int4pack_for_cpu(q, 1), sz))
            experts.append(tuple(pair))
    first = experts[0]
    nbytes = sum(t.numel() * t.element_size() for pair in first for t in (pair if isinstance(pair, tuple) else (pair,)))
    return experts, nbytes


def clone_tree(obj):
    """Deep copy of nested lists/tuples of tensors (a distinct copy of a layer's weights)."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    return type(obj)(clone_tree(o) for o in obj)


def torch_moe(kind: str, experts: list, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Routed MoE with per-expert torch ops (the baseline kernels, same routing and grouping)."""
    out = torch.zeros(x.shape[0], x.shape[1])  # [M, H]
    xa = x if kind == "fp32" else x.to(torch.bfloat16)

    def lin(a: torch.Tensor, p) -> torch.Tensor:
        if kind in ("fp32", "bf16"):
            return F.linear(a, p)
        if kind == "int8":
            return torch._weight_int8pack_mm(a, p[0], p[1])
        return torch._weight_int4pack_mm_for_cpu(a, p[0], 32, p[1])

    for e in torch.unique(ids).tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        gu = lin(xa[tok], experts[e][0])  # [n, 2I]
        inter = gu.shape[1] // 2
        h = F.silu(gu[:, :inter]) * gu[:, inter:]  # [n, I]
        out.index_add_(0, tok, lin(h, experts[e][1]).float() * w[tok, slot, None])
    return out


def kernel_source_at(rev: str) -> Path:
    """kernels/csrc of git revision ``rev`` in a temporary directory -> its moe_cpu.cpp."""
    root = Path(__file__).resolve().parents[2]
    files = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:kernels/csrc"], cwd=root, check=True,
                           capture_output=True, text=True).stdout.split()
    tmp = Path(tempfile.mkdtemp(prefix=f"moegate-kernel-{rev}-"))
    for name in files:
        blob = subprocess.run(["git", "show", f"{rev}:kernels/csrc/{name}"], cwd=root, check=True,
                              capture_output=True).stdout
        (tmp / name).write_bytes(blob)
    return tmp / "moe_cpu.cpp"


def previous_kernel(rev: str, variant: str):
    """The compiled kernel of git revision ``rev`` (its kernels/csrc), for a side-by-side baseline."""
    return build.load_source(variant, kernel_source_at(rev))


def formats_at(rev: str) -> tuple[str, ...]:
    """The expert formats kernels/formats.py of git revision ``rev`` defines (an older kernel must not be
    called with a format code it does not know)."""
    root = Path(__file__).resolve().parents[2]
    src = subprocess.run(["git", "show", f"{rev}:kernels/formats.py"], cwd=root, check=True, capture_output=True,
                         text=True).stdout
    for node in ast.parse(src).body:  # REGISTRY's keys (a literal FORMATS tuple before the registry)
        targets = {getattr(t, "id", "") for t in getattr(node, "targets", [getattr(node, "target", None)])}
        value = getattr(node, "value", None)
        if "REGISTRY" in targets and isinstance(value, ast.Dict):
            return tuple(ast.literal_eval(k) for k in value.keys)
        if "FORMATS" in targets and isinstance(value, ast.Tuple):
            return tuple(ast.literal_eval(value))
    return ()


def simd_path(lib) -> str | None:
    """The SIMD path a loaded kernel library reports (builds before moegate_simd_path existed: by flags)."""
    if lib is None:
        return None
    if hasattr(lib, "moegate_simd_path"):
        return lib.moegate_simd_path().decode()
    return ("avx512: W4A8 ymm vpdpbusd" if lib.moegate_is_vnni() else "avx2: W4A8 maddubs" if lib.moegate_is_avx2()
            else "generic: plain loops")
