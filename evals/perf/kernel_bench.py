"""CPU MoE kernel benchmark: weight GB/s per format and batch size vs STREAM triad and torch baselines.

Reference shape (DESIGN.md): H=1024, I=512, 64 experts, top-8. Each call's bytes are the packed bytes
of the distinct experts it routes to; the packed layers are replicated so the working set is many
times the last-level cache and cycled, so every call streams from DRAM. Writes kernel_bench.json and
kernel_bench.png to --out.  Usage: PYTHONPATH=. python evals/perf/kernel_bench.py [--quick]
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm.auto import tqdm

from evals.perf.common import cpu_busy_fraction
from evals.perf.kernel_baselines import (
    TORCH_KIND,
    clone_tree,
    formats_at,
    previous_kernel,
    simd_path,
    torch_layers,
    torch_moe,
)
from kernels import build, kernel_variant, pack_experts
from kernels.attention import causal_contexts
from kernels.cpu_features import detect
from kernels.formats import FORMAT_CODE
from kernels.fused_moe import run_kernel
from kernels.linear import LINEAR_FORMATS, PackedLinear

H, I, E, TOPK = 1024, 512, 64, 8  # noqa: E741 (the DESIGN.md notation)
WORKING_SET_MIB = 768  # per format (default): >> 32 MiB L3


def path_limited(fn: Callable[[int], None], lib, path: str) -> Callable[[int], None]:
    """fn under the path limit `path` (kernels/csrc/paths.h) for each call, the limit restored after it."""
    level = build.PATH_LEVELS[path]

    def call(i: int) -> None:
        old = lib.moegate_path_limit(level)
        try:
            fn(i)
        finally:
            lib.moegate_path_limit(old)
    return call


def stream_triad(threads: int, n: int = 1 << 26) -> dict[str, float]:
    """STREAM triad (a = b + s*c, 3 x 4 bytes per element) in C with OpenMP; best of 8 runs."""
    lib = build.load(kernel_variant())
    a, b, c = torch.zeros(n), torch.ones(n), torch.ones(n)
    out = {}
    for nt in sorted({1, threads}):
        sec = lib.moegate_stream_triad(a.data_ptr(), b.data_ptr(), c.data_ptr(), n, 8, ctypes.c_int(nt))
        out[f"triad_gbps_{nt}t"] = 12 * n / sec / 1e9
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        b.sum()
        best = min(best, time.perf_counter() - t)
    out["torch_read_sum_gbps"] = 4 * n / best / 1e9
    return out


def routings(m: int, count: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(m)]) for _ in range(count)]


CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}  # --clock


def time_calls(fn: Callable[[int], None], seconds: float, start: int = 0,
               clock: Callable[[], float] = time.perf_counter) -> tuple[list[float], int]:
    """Call fn(i) for i = start, start + 1, ... until ``seconds`` pass (at least 3 calls): seconds per call
    (by ``clock``)."""
    times, i, t0 = [], start, time.perf_counter()
    while i - start < 3 or time.perf_counter() - t0 < seconds:
        t = clock()
        fn(i)
        times.append(clock() - t)
        i += 1
    return times, i


def interleaved(contenders: dict[str, Callable[[int], None]], bytes_of: Callable[[int], int], seconds: float,
                rounds: int, clock: Callable[[], float] = time.perf_counter) -> dict[str, dict[str, float]]:
    """Time every contender in ``rounds`` alternating slices of seconds / rounds each (so load from other
    processes falls on all of them alike); per contender the median and best GB/s over all its calls."""
    calls: dict[str, list[tuple[float, int]]] = {name: [] for name in contenders}
    nxt = dict.fromkeys(contenders, 0)
    for fn in contenders.values():
        fn(0)  # warm-up
    for r in range(rounds):
        order = list(contenders) if r % 2 == 0 else list(contenders)[::-1]
        for name in order:
            times, end = time_calls(contenders[name], seconds / rounds, nxt[name], clock)
            calls[name] += [(dt, i) for dt, i in zip(times, range(nxt[name], end), strict=True)]
            nxt[name] = end
    out = {}
    for name, rows in calls.items():
        # a thread clock reads 0 for a call shorter than its tick (or one the pool's other threads did): such
        # calls carry no rate and are counted, not divided by
        timed = [(dt, i) for dt, i in rows if dt > 0]
        if not timed:
            raise ValueError(f"{name}: every call read 0 s on this clock; time it with --clock wall")
        rates = sorted(bytes_of(i) / dt / 1e9 for dt, i in timed)
        times = sorted(dt for dt, _ in rows)
        out[name] = {"gbps_median": rates[len(rates) // 2], "gbps_best": rates[-1],
                     "ms_median": 1e3 * times[len(times) // 2], "calls": len(rows),
                     "zero_time_calls": len(rows) - len(timed)}
    return out



def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="evals/out/kernels")
    ap.add_argument("--formats", default="bf16,int8,int4,int4_asym")
    ap.add_argument("--ms", default="1,2,4,8,64,128")
    ap.add_argument("--seconds", type=float, default=1.5, help="timed seconds per (impl, format, M)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating slices per point (old, new, torch)")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--baselines", default="fp32,bf16,int8,int4",
                    help="torch baselines run beside the formats they match ('' for none)")
    ap.add_argument("--compare-rev", default=None,
                    help="git revision whose kernel (kernels/csrc) runs beside this one, e.g. 65f89cb")
    ap.add_argument("--dense", default="",
                    help="dense projections N:K (e.g. 151936:1024 the bench checkpoint's lm_head, 2048:1024 its q_proj) "
                         "timed per format through moegate_linear (kernels.linear) beside the experts; '' for none")
    ap.add_argument("--dense-only", action="store_true", help="only the --dense projections, no routed experts")
    ap.add_argument("--attention", default="",
                    help="prefill attention NH:KV:D (e.g. 16:4:64 the bench checkpoint's) at each M of --ms: M tokens "
                         "of one sequence over their causal context through moegate_attention, beside --compare-rev's")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="thread: the calling thread's CPU time per call, with --threads 1 the kernel's own time "
                         "(time descheduled by other processes on a shared machine left out)")
    ap.add_argument("--working-set", type=int, default=WORKING_SET_MIB,
                    help="MiB of weight copies cycled per format (1: one copy, in cache when it fits: the kernel's "
                         "compute ceiling)")
    ap.add_argument("--paths", default="",
                    help="narrower kernel paths (amx, bf16, zmm: kernels.fused_moe.path_limit) timed beside this machine's "
                         "widest, alternating in one process, as contenders moegate/PATH (e.g. bf16,zmm: bf16_a16 on "
                         "vdpbf16ps and on fp32 FMA against AMX)")
    ap.add_argument("--amx-min-rows", type=int, default=0,
                    help="rows of an expert or dense batch from which every a8 format runs on AMX int8 tiles "
                         "(moegate_amx_min_rows; 0: the kernel's defaults, int8_a8 from 32, int4 formats never)")
    ap.add_argument("--quick", action="store_true", help="short run: 0.3 s per point, M=1,8")
    ap.add_argument("--idle-triad", type=float, default=16.0,
                    help="STREAM triad GB/s of this machine when idle (DESIGN.md: 15.6-16.5), a second yardstick "
                         "when other processes share the cores")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.quick:
        args.seconds, args.ms = 0.3, "1,8"
    torch.set_num_threads(args.threads)
    ms = [int(m) for m in args.ms.split(",")]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    variant = kernel_variant()
    lib = build.load(variant)
    if args.amx_min_rows > 0 and hasattr(lib, "moegate_amx_min_rows"):
        for fmt in ("int4", "int4_asym", "int8_a8"):
            lib.moegate_amx_min_rows(FORMAT_CODE[fmt], args.amx_min_rows)
    old = previous_kernel(args.compare_rev, variant) if args.compare_rev else None
    old_formats = formats_at(args.compare_rev) if args.compare_rev else ()
    report: dict = {"shape": {"H": H, "I": I, "E": E, "topk": TOPK}, "threads": args.threads,
                    "cpu": detect().summary(), "cpu_model": detect().model, "machine": platform.node(),
                    "variant": variant, "simd_path": simd_path(lib),
                    "compare_rev": args.compare_rev,
                    "compare_simd_path": simd_path(old), "torch": torch.__version__, "clock": args.clock,
                    "loadavg_before": os.getloadavg(), "busy_before": cpu_busy_fraction()}
    report["stream"] = stream_triad(args.threads)
    triad = report["stream"][f"triad_gbps_{args.threads}t"]
    g = torch.Generator().manual_seed(0)
    formats = [f for f in args.formats.split(",") if f]
    results, ratios = expert_points(lib, old, old_formats, formats, ms, args, g, triad)
    for rows, more in (dense_points(lib, old, old_formats, formats, ms, args, g, triad),
                       attention_points(lib, old, ms, args, g, triad)):
        results += rows
        ratios += more
    report.update(results=results, ratios=ratios, loadavg_after=os.getloadavg(), busy_after=cpu_busy_fraction(),
                  stream_after=stream_triad(args.threads), idle_triad=args.idle_triad)
    (out_dir / "kernel_bench.json").write_text(json.dumps(report, indent=2))
    plot(report, out_dir / "kernel_bench.png")
    print_summary(report, args.threads)
    return 0


def expert_points(lib, old, old_formats: tuple[str, ...], formats: list[str], ms: list[int], args,
                  g: torch.Generator, triad: float) -> tuple[list[dict], list[dict]]:
    """The routed experts per format (and the torch baselines, the formats they match first) at each M, this kernel,
    --compare-rev's and torch alternating: (result rows, speedup ratios)."""
    working_set = args.working_set << 20
    w_gu, w_dn = torch.randn(E, 2 * I, H, generator=g) * 0.02, torch.randn(E, H, I, generator=g) * 0.02
    baselines = [b for b in args.baselines.split(",") if b]
    extra = [b for b in baselines if b not in {TORCH_KIND[f] for f in formats}]  # baselines with no format
    results, ratios = [], []
    expert_formats = [] if args.dense_only else formats + extra
    bar = tqdm(total=len(expert_formats) * len(ms), desc="kernel bench", unit="point")
    for fmt in expert_formats:
        layers, torch_ls, per_expert, torch_pe = None, None, 0, 0
        if fmt in formats:
            base = pack_experts(w_gu, w_dn, fmt, progress=False)
            per_expert = base.expert_nbytes()
            layers = [base] + [type(base)(base.fmt, H, I, base.group_size, base.expert_ids,
                                          {k: v.clone() for k, v in base.tensors.items()})
                               for _ in range(max(1, working_set // base.nbytes) - 1)]
        kind = TORCH_KIND.get(fmt, fmt)
        if kind in baselines and (fmt in extra or fmt == next(f for f in formats if TORCH_KIND[f] == kind)):
            experts, torch_pe = torch_layers(w_gu, w_dn, kind)
            torch_ls = [experts] + [clone_tree(experts) for _ in range(max(1, working_set // (torch_pe * E)) - 1)]
        for m in ms:
            ids_list = routings(m, 16, seed=m)
            x = torch.randn(m, H, generator=g)
            w = torch.softmax(torch.randn(m, TOPK, generator=g), -1)
            uniq = [len(torch.unique(ids)) for ids in ids_list]
            contenders: dict[str, Callable[[int], None]] = {}
            pe: dict[str, int] = {}
            if layers is not None:
                def ours(i: int, kl=lib, layers=layers, ids_list=ids_list, x=x, w=w) -> None:
                    run_kernel(kl, x, ids_list[i % len(ids_list)], w, layers[i % len(layers)], args.threads)

                contenders[f"moegate {fmt}"], pe[f"moegate {fmt}"] = ours, per_expert
                for path in [p for p in args.paths.split(",") if p]:
                    contenders[f"moegate/{path} {fmt}"] = path_limited(ours, lib, path)
                    pe[f"moegate/{path} {fmt}"] = per_expert
                if old is not None and fmt in old_formats:
                    contenders[f"moegate@{args.compare_rev} {fmt}"] = functools.partial(ours, kl=old)
                    pe[f"moegate@{args.compare_rev} {fmt}"] = per_expert
            if torch_ls is not None:
                def theirs(i: int, kind=kind, layers=torch_ls, ids_list=ids_list, x=x, w=w) -> None:
                    torch_moe(kind, layers[i % len(layers)], x, ids_list[i % len(ids_list)], w)

                contenders[f"torch {kind}"], pe[f"torch {kind}"] = theirs, torch_pe
            timed = interleaved(contenders, lambda i, uniq=uniq: uniq[i % len(uniq)], args.seconds * len(contenders),
                                args.rounds, CLOCKS[args.clock])
            point = {}
            for name, res in timed.items():
                impl, f = name.split(" ")
                res = {k: (v * pe[name] if k.startswith("gbps") else v) for k, v in res.items()}  # experts -> bytes
                res.update(impl=impl, fmt=f, M=m, bytes_per_expert=pe[name],
                           pct_stream=100 * res["gbps_median"] / triad,
                           pct_idle_triad_best=100 * res["gbps_best"] / args.idle_triad)
                results.append(res)
                point[name] = res
            ours_name = f"moegate {fmt}"
            if ours_name in point:
                for other, res in point.items():
                    if other != ours_name:  # time ratio: the other's ms per call / ours (same routings)
                        ratios.append({"M": m, "fmt": fmt, "vs": other,
                                       "speedup": res["ms_median"] / point[ours_name]["ms_median"]})
            bar.set_postfix_str(" ".join(f"{n}={r['gbps_median']:.1f}" for n, r in point.items()) + f" M={m}")
            bar.update()
        del layers, torch_ls
    bar.close()
    return results, ratios


def dense_points(lib, old, old_formats: tuple[str, ...], formats: list[str], ms: list[int], args,
                 g: torch.Generator, triad: float) -> tuple[list[dict], list[dict]]:
    """Each --dense projection per linear format at each M (`dense_point`): (result rows, speedup ratios)."""
    results, ratios = [], []
    for shape in [d for d in args.dense.split(",") if d]:
        n, k = (int(v) for v in shape.split(":"))
        for fmt in [f for f in formats if f in LINEAR_FORMATS]:
            for m in ms:
                point = dense_point(lib, old if fmt in old_formats else None, args.compare_rev, fmt, n, k, m, args, g)
                for res in point.values():
                    res["pct_stream"] = 100 * res["gbps_median"] / triad
                    res["pct_idle_triad_best"] = 100 * res["gbps_best"] / args.idle_triad
                    results.append(res)
                ours_name = f"moegate {fmt}"
                for other, res in point.items():
                    if other != ours_name:
                        ratios.append({"M": m, "fmt": fmt, "dense": f"{n}x{k}", "vs": other,
                                       "speedup": res["ms_median"] / point[ours_name]["ms_median"]})
    return results, ratios


def attention_points(lib, old, ms: list[int], args, g: torch.Generator, triad: float) -> tuple[list[dict], list[dict]]:
    """Each --attention shape at each M (`attention_point`): (result rows, speedup ratios)."""
    results, ratios = [], []
    for shape in [a for a in args.attention.split(",") if a]:
        for m in ms:
            point = attention_point(lib, old, args.compare_rev, *(int(v) for v in shape.split(":")), m, args, g)
            for res in point.values():
                results.append(dict(res, pct_stream=100 * res["gbps_median"] / triad,
                                    pct_idle_triad_best=100 * res["gbps_best"] / args.idle_triad))
            ratios += [{"M": m, "fmt": "fp32", "dense": res["dense"], "vs": other,
                        "speedup": res["ms_median"] / point["moegate fp32"]["ms_median"]}
                       for other, res in point.items() if other != "moegate fp32"]
    return results, ratios


def print_summary(report: dict, threads: int) -> None:
    """The run's rows and ratios, with the machine's load and STREAM triad before and after."""
    triad, results, ratios = report["stream"][f"triad_gbps_{threads}t"], report["results"], report["ratios"]
    print(f"{report['cpu_model']}: {report['cpu']}; kernel {report['variant']} ({report['simd_path']}); "
          f"STREAM triad {triad:.1f} GB/s ({threads} threads); loadavg before {report['loadavg_before']}")
    for r in results:
        print(f"{r['impl']:16s} {r['fmt']:9s} {r.get('dense', 'experts'):12s} M={r['M']:3d}  {r['gbps_median']:6.2f} GB/s median "
              f"({r['gbps_best']:6.2f} best)  {r['pct_stream']:5.1f}% of this run's triad (median), "
              f"{r['pct_idle_triad_best']:5.1f}% of idle triad (best)  {r['ms_median']:.3f} ms/call")
    for r in ratios:
        print(f"moegate {r['fmt']:9s} {r.get('dense', 'experts'):12s} M={r['M']:3d}  {r['speedup']:5.2f}x vs {r['vs']} "
              "(median ms per call)")
    print(f"STREAM triad after: {report['stream_after']}; loadavg after {report['loadavg_after']}; "
          f"busy {report['busy_before']:.2f} before / {report['busy_after']:.2f} after")


def dense_point(lib, old, rev: str | None, fmt: str, n: int, k: int, m: int, args, g: torch.Generator) -> dict:
    """One dense projection W [n, k] in ``fmt`` at M = m through moegate_linear (this kernel and, with
    ``old``, revision ``rev``'s), alternating; copies of W cycled (--working-set) so every call streams from
    DRAM. Bytes per call: the packed weights and scales."""
    base = PackedLinear.pack(torch.randn(n, k, generator=g) * 0.02, fmt)
    copies = [base] + [PackedLinear(fmt, n, k, base.group_size, {key: t.clone() for key, t in base.tensors.items()})
                       for _ in range(max(1, (args.working_set << 20) // base.nbytes) - 1)]
    x = torch.randn(m, k, generator=g)
    out = torch.empty(m, base.padded_out)

    def call(i: int, kl=lib) -> None:
        t = copies[i % len(copies)].tensors
        rc = kl.moegate_linear(x.data_ptr(), out.data_ptr(), m, n, k, FORMAT_CODE[fmt], base.group_size,
                               t["weight"].data_ptr(), t["scales"].data_ptr() if t["scales"].numel() else None,
                               t["mins"].data_ptr() if t["mins"].numel() else None, ctypes.c_int(args.threads))
        if rc != 0:
            raise RuntimeError(f"moegate_linear failed with code {rc}")

    contenders = {f"moegate {fmt}": call}
    for path in [p for p in args.paths.split(",") if p]:
        contenders[f"moegate/{path} {fmt}"] = path_limited(call, lib, path)
    if old is not None:
        contenders[f"moegate@{rev} {fmt}"] = functools.partial(call, kl=old)
    seconds = args.seconds * len(contenders)
    timed = interleaved(contenders, lambda i: base.nbytes, seconds, args.rounds, CLOCKS[args.clock])
    return {name: dict(res, impl=name.split(" ")[0], fmt=fmt, M=m, dense=f"{n}x{k}", bytes_per_call=base.nbytes)
            for name, res in timed.items()}


def attention_point(lib, old, rev: str | None, nh: int, kv: int, d: int, m: int, args, g: torch.Generator) -> dict:
    """Prefill attention of m tokens (one sequence, each over its causal context in a paged fp32 cache) through
    moegate_attention (this kernel and, with ``old``, revision ``rev``'s), alternating. Bytes per call: the K and
    V rows the (token, head) pairs read."""
    k_cache, v_cache = torch.randn(m + 8, kv, d, generator=g), torch.randn(m + 8, kv, d, generator=g)
    q = torch.randn(m, nh, d, generator=g)
    slots, start, length = (a.to(torch.int64).contiguous()
                            for a in causal_contexts([m], [m], [torch.randperm(m + 8, generator=g)[:m]]))
    out = torch.empty(m, nh, d)

    def call(i: int, kl=lib) -> None:
        rc = kl.moegate_attention(q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
                                  slots.data_ptr(), start.data_ptr(), length.data_ptr(), m, nh, kv, d, 0,
                                  ctypes.c_double(d**-0.5), out.data_ptr(), ctypes.c_int(args.threads))
        if rc != 0:
            raise RuntimeError(f"moegate_attention failed with code {rc}")

    contenders = {"moegate fp32": call}
    if old is not None and hasattr(old, "moegate_attention"):
        contenders[f"moegate@{rev} fp32"] = functools.partial(call, kl=old)
    nbytes = 4 * 2 * nh * d * int(length.sum())
    timed = interleaved(contenders, lambda i: nbytes, args.seconds * len(contenders), args.rounds, CLOCKS[args.clock])
    return {name: dict(res, impl=name.split(" ")[0], fmt="fp32", M=m, dense=f"attention {nh}x{kv}x{d}",
                       bytes_per_call=nbytes) for name, res in timed.items()}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    triad = report["stream"][f"triad_gbps_{report['threads']}t"]
    series: dict[tuple[str, str], list] = {}
    for r in report["results"]:
        series.setdefault((r["impl"], r["fmt"] + (f" {r['dense']}" if "dense" in r else "")), []).append(
            (r["M"], r["gbps_median"]))
    for (impl, fmt), pts in series.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", linestyle="-" if impl == "moegate" else "--",
                label=f"{impl} {fmt}")
    ax.axhline(triad, color="k", linewidth=1, label=f"STREAM triad {triad:.1f} GB/s")
    ax.axhline(0.8 * triad, color="k", linewidth=1, linestyle=":", label="80% of triad")
    ax.axhline(report["idle_triad"], color="grey", linewidth=1, label=f"idle triad {report['idle_triad']:.0f} GB/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per call (M)")
    ax.set_ylabel("weight GB/s (distinct experts' bytes / time)")
    ax.set_title(f"routed MoE H={H} I={I} E={E} top-{TOPK}, {report['threads']} threads, "
                 f"load {report['loadavg_before'][0]:.1f}")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
