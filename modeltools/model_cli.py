"""`moegate model ...`: model utilities (random checkpoints for tests and benchmarks)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from modeltools.random_checkpoint import ARCHS, DTYPES, VOCABS, write_random_checkpoint

# Each preset gives every size option; command-line flags override single values.
PRESETS: dict[str, dict[str, object]] = {
    "tiny": dict(hidden_size=64, num_layers=2, num_experts=8, top_k=2, moe_intermediate_size=32,
                 num_heads=4, num_kv_heads=2, vocab="bpe", dtype="float32"),
    # The reference model of the benchmarks: Qwen3-MoE shape scaled to one box (~0.9B params).
    "bench": dict(hidden_size=1024, num_layers=8, num_experts=64, top_k=8, moe_intermediate_size=512,
                  num_heads=16, num_kv_heads=4, vocab="qwen", dtype="bfloat16"),
}

# flag -> write_random_checkpoint keyword
_SIZE_FLAGS = {
    "hidden_size": "hidden_size", "layers": "num_layers", "experts": "num_experts", "top_k": "top_k",
    "moe_intermediate": "moe_intermediate_size", "heads": "num_heads", "kv_heads": "num_kv_heads",
    "head_dim": "head_dim", "vocab": "vocab", "dtype": "dtype",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    model = subparsers.add_parser("model", help="model utilities")
    model_sub = model.add_subparsers(dest="model_command", required=True)
    init = model_sub.add_parser("init-random", help="write a random-weight MoE checkpoint (HF layout)")
    init.add_argument("--arch", choices=ARCHS, default="qwen3_moe")
    init.add_argument("--out", type=Path, required=True, help="output directory")
    init.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                      help="base sizes: tiny (tests) or bench (hidden 1024, 8 layers, 64 experts top-8, qwen vocab)")
    init.add_argument("--hidden-size", type=int)
    init.add_argument("--layers", type=int)
    init.add_argument("--experts", type=int)
    init.add_argument("--top-k", type=int)
    init.add_argument("--moe-intermediate", type=int)
    init.add_argument("--heads", type=int)
    init.add_argument("--kv-heads", type=int)
    init.add_argument("--head-dim", type=int)
    init.add_argument("--vocab", choices=VOCABS)
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--dtype", choices=sorted(DTYPES), help="default: float32 (tiny), bfloat16 (bench)")
    init.set_defaults(func=_init_random)


def checkpoint_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """The preset's sizes with the flags that were given laid over them."""
    kw = dict(PRESETS[args.preset])
    for flag, key in _SIZE_FLAGS.items():
        value = getattr(args, flag)
        if value is not None:
            kw[key] = value
    return kw


def _init_random(args: argparse.Namespace) -> int:
    kw = checkpoint_kwargs(args)
    start = time.perf_counter()
    out = write_random_checkpoint(args.out, args.arch, seed=args.seed, progress=True, **kw)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    summary = {"out": str(out), "arch": args.arch, "seed": args.seed, **kw,
               "bytes": size, "seconds": round(time.perf_counter() - start, 2)}
    print(json.dumps(summary))
    return 0
