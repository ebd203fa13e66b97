"""Prefill with the torch attention and router against the kernels' (kernels.attention, kernels.router), alternating
in one process: on a shared machine, prefills a second apart see the same load, which runs in separate processes
minutes apart do not. 128-token prefills of the bench checkpoint per format; every run, medians, paired ratios.

Usage: PYTHONPATH=. python -m evals.perf.prefill_kernels_ab [--formats int4,int8,bf16] [--rounds 10] [--threads 1]
[--out DIR]
Writes prefill_kernels_ab.json and .png to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from evals.perf.common import machine_info, save_bar_plot


def use_kernels(on: bool) -> None:
    """The engine's attention and router on the kernels (on) or on their torch references (main before them)."""
    import engine.models.attention as attention
    import engine.models.moe as moe
    from kernels.attention import kernel_takes
    from kernels.router import route, router_reference

    attention.kernel_takes = kernel_takes if on else (lambda *a: False)
    moe.route = route if on else (lambda *a, **k: router_reference(*a))


def run_format(model: str, fmt: str, rounds: int, prompt_len: int, pack_dir: str) -> dict:
    from engine.experts import PlacementConfig
    from engine.llm_engine import LLM
    from engine.sampling_params import SamplingParams

    placement = PlacementConfig(fast_format=fmt, exact_format=fmt, pack_cache_dir=pack_dir)
    llm = LLM(
        model,
        dtype="float32",
        placement=placement,
        num_kv_blocks=64,
        prefix_cache=False,
        fast_lm_head="int8",
        fast_dense=fmt,
        progress=False,
    )
    prompt = torch.randint(0, 150000, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    for on in (False, True):  # warm-up: kernel build, first touch
        use_kernels(on)
        llm.generate([prompt], params)
    runs: dict[str, list[float]] = {"torch": [], "kernels": []}
    cpu_ms: dict[str, list[float]] = {"torch": [], "kernels": []}  # process CPU time per prefill
    for r in range(rounds):  # ABBA order
        for name in ("torch", "kernels") if r % 2 == 0 else ("kernels", "torch"):
            use_kernels(name == "kernels")
            t, c = time.perf_counter(), time.process_time()
            llm.generate([prompt], params)
            cpu_ms[name].append(round(1000 * (time.process_time() - c), 1))
            runs[name].append(round(prompt_len / (time.perf_counter() - t), 1))
    llm.engine.runner.shutdown()
    use_kernels(True)
    median = {k: statistics.median(v) for k, v in runs.items()}
    cpu = {k: statistics.median(v) for k, v in cpu_ms.items()}
    return {
        "prefill_tok_s": runs,
        "median": median,
        "ratio_of_medians": median["kernels"] / median["torch"],
        "paired_ratios": [round(k / t, 3) for k, t in zip(runs["kernels"], runs["torch"], strict=True)],
        "cpu_ms": cpu_ms,
        "median_cpu_ms": cpu,
        "cpu_torch_over_kernels": cpu["torch"] / cpu["kernels"],
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: engine_bench's reference model)")
    ap.add_argument("--formats", default="int4,int8,bf16", help="experts and attention format of each run")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch and kernel threads (default: torch's); with 1, "
        "the process CPU time per prefill is the work done, whatever else runs on the machine",
    )
    ap.add_argument("--out", default="evals/out/prefill_kernels_ab")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from evals.perf.engine_bench import ensure_reference_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = args.model or str(ensure_reference_model(out.parent / "models" / "bench-ref"))
    result: dict = {
        "model": model,
        "prompt_len": args.prompt_len,
        "threads": torch.get_num_threads(),
        "machine": machine_info(),
        "loadavg_before": os.getloadavg(),
        "formats": {},
    }
    for fmt in args.formats.split(","):
        result["formats"][fmt] = run_format(model, fmt, args.rounds, args.prompt_len, str(out / "pack"))
        print(fmt, json.dumps(result["formats"][fmt]), "loadavg", os.getloadavg(), flush=True)
    result["loadavg_after"] = os.getloadavg()
    (out / "prefill_kernels_ab.json").write_text(json.dumps(result, indent=2))
    fm = result["formats"]
    save_bar_plot(
        out / "prefill_kernels_ab.png",
        f"prefill {args.prompt_len} tokens, median of {args.rounds} runs",
        {
            "prefill tok/s": {f"{f} {k}": v for f, r in fm.items() for k, v in r["median"].items()},
            "kernels / torch": {f: r["ratio_of_medians"] for f, r in fm.items()},
            "CPU time torch / kernels": {f: r["cpu_torch_over_kernels"] for f, r in fm.items()},
        },
    )
    return result


if __name__ == "__main__":
    main()
