"""Peak host memory while loading a checkpoint: streamed (experts packed one at a time) vs materialised
(the whole model at full precision, then packed layer by layer, as the loader did before streaming).

Each load runs in a child process; the parent samples the child's /proc/<pid>/status every 20 ms and
reports the peak of RssAnon (anonymous memory: what the load allocates) beside RssFile (the
checkpoint's memory-mapped pages, file-backed: the kernel drops them under pressure, so they are shown
but not counted). Target (issue 22): peak anonymous <= 1.3 x packed size + 1.5 GiB, where the packed
size is what the loaded model holds (dense part in the model dtype + every resident expert shard).
`moegate plan`'s prediction of the same peak is printed beside it.

Reference checkpoint (default): random Qwen3-MoE bench preset with 10 layers (~2.5 GiB bf16), written
under /tmp if absent and deleted afterwards unless --keep. Usage:
    python -m evals.perf.load_bench [--model DIR] [--dtype float32] [--placements int4,int4+int8]
Writes evals/perf/results/load_bench.json and load_bench.png.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

GIB = 2**30
RESULTS = Path(__file__).parent / "results"
DEFAULT_CKPT = Path("/tmp/moegate-load-bench-ckpt")
# name -> PlacementConfig kwargs (int4+int8: a policy with int4 for exploration, int8 for execution and
# bf16 on the last 2 MoE layers: both profiles resident)
PLACEMENTS = {
    "int4": dict(fast_format="int4", exact_format="int4"),
    "int4+int8": dict(fast_format="int4", execution_format="int8", exact_format="bf16", formatting_layers=2),
}


def _status(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:", "VmRSS:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out


def _child(args: argparse.Namespace) -> None:
    """Runs one load in this process and prints its JSON (the parent measures memory from outside)."""
    import torch

    from engine.experts import PlacementConfig
    from engine.loader import load_model
    from kernels import pack_experts

    dtype = getattr(torch, args.dtype)
    placement = PlacementConfig(**PLACEMENTS[args.placement])
    print(json.dumps({"event": "imported"}), flush=True)
    t = time.perf_counter()
    if args.child == "streamed":
        model = load_model(args.model, dtype=dtype, placement=placement, progress=False)
    else:  # materialised: every expert at full precision first, then packed layer by layer and freed
        from engine.experts import ExpertShard, LayerExperts, plan_layers

        model = load_model(args.model, dtype=dtype, progress=False)
        for i, plan in plan_layers(model.config, placement, torch.device("cpu")).items():
            experts = model.model.layers[i].mlp.experts
            built = {}
            for spec in plan.shards:
                ids = list(spec.expert_ids)
                built[spec] = ExpertShard(pack_experts(experts.gate_up_proj[ids], experts.down_proj[ids], spec.fmt,
                                                       progress=False, expert_ids=spec.expert_ids),
                                          torch.device("cpu"))
            experts.packed = LayerExperts([built[s] for s in plan.fast], [built[s] for s in plan.exact])
            experts.gate_up_proj = torch.nn.Parameter(torch.empty(0), requires_grad=False)
            experts.down_proj = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    seconds = time.perf_counter() - t
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    experts = sum(layer.mlp.experts.packed.nbytes for layer in model.model.layers if layer.is_moe)
    print(json.dumps({"event": "loaded", "seconds": seconds, "dense_bytes": dense, "experts_bytes": experts}),
          flush=True)


def _measure(model: Path, mode: str, placement: str, dtype: str) -> dict:
    cmd = [sys.executable, "-m", "evals.perf.load_bench", "--child", mode, "--model", str(model),
           "--placement", placement, "--dtype", dtype]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    start, samples, events = time.perf_counter(), [], {}
    import threading

    def read_events() -> None:
        for line in proc.stdout:
            msg = json.loads(line)
            events[msg.pop("event")] = {**msg, "at": time.perf_counter() - start}

    reader = threading.Thread(target=read_events, daemon=True)
    reader.start()
    while proc.poll() is None:
        try:
            s = _status(proc.pid)
        except (FileNotFoundError, ProcessLookupError):
            break
        if "RssAnon" in s:
            samples.append((time.perf_counter() - start, s["RssAnon"], s["RssFile"]))
        if "loaded" in events:  # measured what it holds after the load: stop it
            proc.terminate()
        time.sleep(0.02)
    proc.wait()
    reader.join(timeout=5)
    if "loaded" not in events:
        raise RuntimeError(f"{mode} load of {model} failed (exit code {proc.returncode})")
    loaded, base_at = events["loaded"], events["imported"]["at"]
    before = [a for t, a, _ in samples if t <= base_at] or [samples[0][1]]
    packed = loaded["dense_bytes"] + loaded["experts_bytes"]
    peak = max(a for _, a, _ in samples)
    return {"mode": mode, "placement": placement, "seconds": loaded["seconds"], "packed_bytes": packed,
            "dense_bytes": loaded["dense_bytes"], "experts_bytes": loaded["experts_bytes"],
            "peak_anon_bytes": peak, "anon_after_imports_bytes": before[-1],
            "peak_file_bytes": max(f for _, _, f in samples), "target_bytes": int(1.3 * packed + 1.5 * GIB),
            "meets_target": peak <= 1.3 * packed + 1.5 * GIB,
            "timeline": [(round(t, 2), a, f) for t, a, f in samples[::10]]}


def _plan_peak(model: Path, placement: str, dtype: str) -> int:
    from modeltools.plan import PlanOptions, build_plan

    p = PLACEMENTS[placement]
    dense = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[dtype]
    opts = PlanOptions(experts_precision=p["fast_format"], dense_precision=dense, device="cpu", kv_tokens=0,
                       execution_precision=p.get("execution_format"), formatting_layers=p.get("formatting_layers", 0),
                       formatting_precision=p["exact_format"])
    return build_plan(model, opts, bandwidth_gbps=1.0).load_peak_bytes


def _plot(path: Path, runs: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    placements = sorted({r["placement"] for r in runs}, key=list(PLACEMENTS).index)
    fig, axes = plt.subplots(1, len(placements), figsize=(7 * len(placements), 4.5), squeeze=False)
    for ax, name in zip(axes[0], placements, strict=True):
        for r in (r for r in runs if r["placement"] == name):
            ts = [t for t, _, _ in r["timeline"]]
            ax.plot(ts, [a / GIB for _, a, _ in r["timeline"]], label=f"{r['mode']}: anonymous "
                    f"(peak {r['peak_anon_bytes'] / GIB:.2f} GiB, {r['seconds']:.0f} s)")
            ax.plot(ts, [f / GIB for _, _, f in r["timeline"]], ls=":", label=f"{r['mode']}: file-backed (mmap)")
        r = next(r for r in runs if r["placement"] == name)
        ax.axhline(r["packed_bytes"] / GIB, color="gray", ls="--", label=f"packed size {r['packed_bytes'] / GIB:.2f} GiB")
        ax.axhline(r["target_bytes"] / GIB, color="red", ls="--", label=f"target {r['target_bytes'] / GIB:.2f} GiB")
        ax.axhline((r["plan_peak_bytes"] + r["anon_after_imports_bytes"]) / GIB, color="green", ls="-.",
                   label="moegate plan + imports")
        ax.set_title(f"experts {name}")
        ax.set_xlabel("seconds")
        ax.set_ylabel("GiB")
        ax.legend(fontsize=7)
    fig.suptitle("host memory while loading: streamed vs materialised")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, help="checkpoint dir (default: a random bench checkpoint under /tmp)")
    ap.add_argument("--layers", type=int, default=10, help="layers of the random checkpoint")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                    help="model dtype (the dense part; `moegate serve` default float32)")
    ap.add_argument("--placements", default=",".join(PLACEMENTS))
    ap.add_argument("--modes", default="streamed,materialised")
    ap.add_argument("--keep", action="store_true", help="keep the random checkpoint")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--child", choices=("streamed", "materialised"), help=argparse.SUPPRESS)
    ap.add_argument("--placement", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child(args)
        return {}
    from tqdm.auto import tqdm

    from evals.perf.common import machine_info

    model, made = args.model, False
    if model is None:
        model = DEFAULT_CKPT
        if not (model / "config.json").is_file():
            from modeltools.model_cli import PRESETS
            from modeltools.random_checkpoint import write_random_checkpoint

            write_random_checkpoint(model, "qwen3_moe", **{**PRESETS["bench"], "num_layers": args.layers}, progress=True)
            made = True
    try:
        runs = []
        jobs = [(m, p) for p in args.placements.split(",") for m in args.modes.split(",")]
        for mode, placement in tqdm(jobs, desc="loads", unit="load"):
            run = _measure(model, mode, placement, args.dtype)
            run["plan_peak_bytes"] = _plan_peak(model, placement, args.dtype)
            runs.append(run)
            tqdm.write(f"{placement:>10} {mode:>12}: peak anonymous {run['peak_anon_bytes'] / GIB:.2f} GiB "
                       f"(packed {run['packed_bytes'] / GIB:.2f}, target {run['target_bytes'] / GIB:.2f}, "
                       f"plan {run['plan_peak_bytes'] / GIB:.2f} + imports "
                       f"{run['anon_after_imports_bytes'] / GIB:.2f}), {run['seconds']:.1f} s")
        ckpt_bytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    finally:
        if made and not args.keep:
            shutil.rmtree(model, ignore_errors=True)
    report = {"machine": machine_info(), "checkpoint": str(model), "checkpoint_bytes": ckpt_bytes,
              "dtype": args.dtype, "placements": {k: PLACEMENTS[k] for k in args.placements.split(",")}, "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "load_bench.json").write_text(json.dumps(report, indent=1))
    _plot(args.out / "load_bench.png", runs)
    return report


if __name__ == "__main__":
    main()
