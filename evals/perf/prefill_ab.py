"""Prefill A/B of two checkouts (kernels and Python together, where engine_bench --compare-rev swaps only the
kernel source): 128-token prefills of the bench checkpoint, each side in fresh processes, alternating.

Usage: PYTHONPATH=. python evals/perf/prefill_ab.py --base /path/to/other/checkout [--rounds 2]
(`git worktree add --detach /tmp/base <rev>` makes one). Writes prefill_ab.json to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from evals.perf.common import machine_info


def child(model: str, fmt: str, lm_head: str, prefills: int, prompt_len: int) -> None:
    """In the checkout on PYTHONPATH: load once, warm up, print one 'prefill <tok/s>' line per prefill."""
    import torch

    from engine.experts import PlacementConfig
    from engine.llm_engine import LLM
    from engine.sampling_params import SamplingParams

    placement = PlacementConfig(fast_format=fmt, exact_format=fmt, pack_cache_dir=str(Path(model).parent / "pack"))
    llm = LLM(model, dtype="float32", placement=placement, num_kv_blocks=64, prefix_cache=False,
              fast_lm_head=lm_head, fast_dense=fmt, progress=False)
    prompt = torch.randint(0, 150000, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    llm.generate([prompt[:16]], SamplingParams(max_tokens=2))  # kernel build, first touch
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    for _ in range(prefills):
        t = time.perf_counter()
        llm.generate([prompt], params)
        print(f"prefill {prompt_len / (time.perf_counter() - t):.2f}", flush=True)
    llm.engine.runner.shutdown()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the other checkout's root")
    ap.add_argument("--model", default=None, help="checkpoint dir (default: engine_bench's reference model)")
    ap.add_argument("--formats", default="int4,int8", help="experts and attention format of each run")
    ap.add_argument("--lm-head", default="int8")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prefills", type=int, default=4, help="prefills per process (the best counts)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--out", default="evals/out/prefill_ab")
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "FMT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child[0], args.child[1], args.lm_head, args.prefills, args.prompt_len)
        return {}
    from evals.perf.engine_bench import ensure_reference_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = args.model or str(ensure_reference_model(out.parent / "models" / "bench-ref"))
    sides = {"base": str(Path(args.base).resolve()), "this": str(Path.cwd())}
    runs: dict[str, list[float]] = {f"{s} {f}": [] for f in args.formats.split(",") for s in sides}
    info = machine_info()
    for r in range(args.rounds):
        for fmt in args.formats.split(","):
            for side, root in sides.items():
                env = {**os.environ, "PYTHONPATH": root}
                cmd = [sys.executable, str(Path(__file__).resolve()), "--base", args.base, "--lm-head", args.lm_head,
                       "--prefills", str(args.prefills), "--prompt-len", str(args.prompt_len), "--child", model, fmt]
                text = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, check=True).stdout
                best = max(float(line.split()[1]) for line in text.splitlines() if line.startswith("prefill "))
                runs[f"{side} {fmt}"].append(best)
                print(f"round {r} {side} {fmt}: {best:.1f} tok/s, loadavg {os.getloadavg()}", flush=True)
    median = {k: statistics.median(v) for k, v in runs.items()}
    ratios = {f"{f} prefill this/base": median[f"this {f}"] / median[f"base {f}"] for f in args.formats.split(",")}
    result = {"base": sides["base"], "model": model, "prompt_len": args.prompt_len, "lm_head": args.lm_head,
              "machine": info, "runs": runs, "median": median, "ratios": ratios,
              "loadavg_after": os.getloadavg()}
    (out / "prefill_ab.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(ratios, indent=1))
    return result


if __name__ == "__main__":
    main()
