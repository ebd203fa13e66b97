"""End-to-end prefill and decode tok/s: moegate (per expert format) vs transformers eager and, with
`--llama-cpp`, llama.cpp's native `llama-bench` at matched precision, same checkpoint, same threads, in ONE run.

Reference model (default): random Qwen3-MoE, hidden 1024, 8 layers, 64 experts top-8, moe_intermediate
512, 16 / 4 heads, Qwen vocabulary (`moegate model init-random --preset bench`). Writes engine_bench.json
and engine_bench.png; reports ratios. `--llama-cpp` runs the MATCHED rows instead of the per-format plan:
each moegate precision beside the llama.cpp GGUF type it matches (evals/perf/llama_cpp.py builds the
tools and the files once). Usage:
    python -m evals.perf.engine_bench [--model DIR] [--llama-cpp] [--quick]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from evals.perf import llama_cpp
from evals.perf.common import machine_info, save_bar_plot
from evals.perf.llama_cpp import MATCHED, format_matched, pair_rows
from evals.perf.step_breakdown import decode_step_breakdown


def _moegate(model: str, fmt: str, dense: str, prompt: list[int], decode: int, defer: int = 0,
             pack_dir: str | None = None, lm_head: str | None = None, fast_dense: str | None = None,
             kernel_source: str | None = None) -> dict:
    if kernel_source:  # an earlier revision's kernel (--compare-rev): this process builds and loads that source
        from kernels import build

        build.SOURCE = Path(kernel_source)
    from engine.experts import PlacementConfig
    from engine.llm_engine import LLM

    placement = PlacementConfig(fast_format=fmt, exact_format=fmt, pack_cache_dir=pack_dir)
    t = time.perf_counter()
    llm = LLM(model, dtype=dense, placement=placement, defer=defer, num_kv_blocks=64, prefix_cache=False,
              fast_lm_head=lm_head, fast_dense=fast_dense, progress=False)  # no prefix cache: every prefill is computed
    return _measure(llm, time.perf_counter() - t, prompt, decode, "exploration", dense)


def _moegate_execution(model: str, dense: str, prompt: list[int], decode: int) -> dict:
    """Execution mode with the dev policy's profiles, configured as `moegate serve` configures its engine."""
    from evals.perf.mode_streams import policy_llm

    t = time.perf_counter()
    llm = policy_llm(model, dtype=dense, num_kv_blocks=64)
    return _measure(llm, time.perf_counter() - t, prompt, decode, "execution", dense)


def _measure(llm, load_s: float, prompt: list[int], decode: int, mode: str, dense: str) -> dict:
    from engine.sampling_params import SamplingParams

    _timed_request(llm.engine, prompt[:16], SamplingParams(max_tokens=2), mode)  # warm-up (kernel build, first touch)
    params = SamplingParams(max_tokens=decode + 1, ignore_eos=True)
    runs = [_timed_request(llm.engine, prompt, params, mode) for _ in range(3)]
    steps = decode_step_breakdown(llm.engine, prompt, params, mode)
    parts = llm.engine.numerics.parts(mode, dense)
    tokens = vars(llm.engine.decoder.stats)  # forced / drafted tokens: 0 unless multi-token decoding ran
    llm.engine.runner.shutdown()
    pre = min(r[0] for r in runs)
    dec = min(r[1] for r in runs)
    return {"load_s": load_s, "prefill_tok_s": len(prompt) / pre, "decode_tok_s": decode / dec,
            "decode_step_ms": steps, "mode": mode, "precision": parts, "multi_token": dict(tokens)}


def _timed_request(engine, prompt: list[int], params, mode: str = "exploration") -> tuple[float, float]:
    """One request through the engine's step loop: (seconds to the first token, seconds for the rest).

    Timing the two phases of the same request keeps prefill noise out of the decode figure (subtracting a
    separately timed prefill from a whole generate did not)."""
    engine.add_request("bench", prompt, params, mode)
    start, first = time.perf_counter(), None
    while engine.has_work():
        if engine.step() and first is None:
            first = time.perf_counter()
    return first - start, time.perf_counter() - first


def _transformers(model: str, dtype: torch.dtype, prompt: list[int], decode: int) -> dict:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation="eager").eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        m(ids[:, :16])
        pre = _best(lambda: m(ids))
        total = _best(lambda: m.generate(ids, max_new_tokens=decode + 1, min_new_tokens=decode + 1,
                                         do_sample=False, pad_token_id=0), n=2)
    return {"prefill_tok_s": len(prompt) / pre, "decode_tok_s": decode / max(total - pre, 1e-9)}


def matched_plan(model: str, dense: str, prompt: list[int], decode: int, pack: str, gguf: dict[str, Path],
                 threads: int, rows=MATCHED) -> list[tuple]:
    """Each peer file's llama-bench run, then the moegate rows it serves: rows and their peer run side by side."""
    plan = []
    for peer in dict.fromkeys(r.peer for r in rows):
        plan.append((f"llama.cpp-{peer}", llama_cpp.bench_peer, (str(gguf[peer]), len(prompt), decode, threads), {}))
        for row in (r for r in rows if r.peer == peer):
            if row.fmt is None:
                plan.append((row.run, _moegate_execution, (model, dense, prompt, decode), {}))
            else:
                plan.append((row.run, _moegate, (model, row.fmt, dense, prompt, decode),
                             {"pack_dir": pack, "lm_head": row.lm_head, "fast_dense": row.attention}))
    return plan


def _best(fn, n: int = 3) -> float:
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def ensure_reference_model(path: Path) -> Path:
    if not (path / "config.json").is_file():
        from modeltools.random_checkpoint import write_random_checkpoint

        write_random_checkpoint(path, "qwen3_moe", hidden_size=1024, num_layers=8, num_experts=64, top_k=8,
                                moe_intermediate_size=512, num_heads=16, num_kv_heads=4, vocab="qwen",
                                dtype="bfloat16", seed=0)
    return path


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the bench reference model)")
    ap.add_argument("--out", default="evals/out/engine")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--formats", default="int4,int8,bf16")
    ap.add_argument("--dense", default="float32", help="dtype of the dense path for moegate")
    ap.add_argument("--lm-head", default="int8,int4",
                    help="exploration lm_heads of the moegate-*+fast runs (comma list of int4|int8|bf16|bf16_a16|int8_a8, "
                         "or 'match' for the experts' format: with --fast-dense match the MATCHED rows' "
                         "'everything' runs)")
    ap.add_argument("--fast-dense", default="match",
                    help="exploration attention projections of the +fast runs: int4|int8|bf16, or 'match' for the "
                         "experts' format (as llama.cpp's Q4_0 / Q8_0 quantize attention like the experts)")
    ap.add_argument("--llama-cpp", action="store_true",
                    help="the MATCHED rows against llama.cpp's native llama-bench (built and converted once) "
                         "instead of the --formats / --lm-head / --fast-dense / --fast-only plan")
    ap.add_argument("--peers", help="--llama-cpp: only the rows against these llama.cpp files, e.g. Q8_0,BF16")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--fast-only", action="store_true",
                    help="only the +fast runs (quantized attention and lm_head), not the default profile")
    ap.add_argument("--compare-rev", default=None,
                    help="git revision whose kernel (kernels/csrc) runs the same moegate configurations, "
                         "alternating with this one, e.g. 65f89cb")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run the whole plan this many times (alternating with --compare-rev's); medians reported")
    ap.add_argument("--quick", action="store_true", help="short prompt and decode")
    return ap


def main(argv: list[str] | None = None) -> dict:
    ap = _parser()
    args = ap.parse_args(argv)
    plan_options = ("formats", "lm_head", "fast_dense", "fast_only", "compare_rev")
    if args.llama_cpp and any(getattr(args, k) != ap.get_default(k) for k in plan_options):
        ap.error("--llama-cpp runs the MATCHED rows; it does not combine with " +
                 ", ".join("--" + k.replace("_", "-") for k in plan_options))
    rows = _matched_rows(ap, args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.quick:
        args.prompt_len, args.decode = 32, 8
    model = args.model or str(ensure_reference_model(out.parent / "models" / "bench-ref"))
    threads = torch.get_num_threads()
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    prompt = torch.randint(0, min(vocab, 150000), (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    info, peer_info = machine_info(), None
    if args.llama_cpp:
        llama_cpp.build()
        gguf = llama_cpp.peer_files(Path(model), out / "gguf", list(dict.fromkeys(r.peer for r in rows)))
        peer_info = {"source": llama_cpp.source_dir().parents[1].name, "simd": llama_cpp.simd_flags(),
                     "files": {k: str(v) for k, v in gguf.items()}}
        print(f"llama.cpp ({peer_info['source']}): {peer_info['simd']}")
        plan = matched_plan(model, args.dense, prompt, args.decode, str(out / "pack"), gguf, threads, rows)
    else:
        plan = _format_plan(args, model, prompt, str(out / "pack"))
    plan = [(f"{name}#{r}" if args.repeats > 1 else name, fn, fa, kw) for r in range(args.repeats)
            for name, fn, fa, kw in plan]
    if not args.no_transformers:
        plan += [("transformers-eager-bf16", _transformers, (model, torch.bfloat16, prompt, args.decode), {}),
                 ("transformers-eager-fp32", _transformers, (model, torch.float32, prompt, args.decode), {})]
    runs = _run_plan(plan)
    summary = median_runs(runs)
    ratios, matched = _ratios(summary, args.compare_rev), None
    if args.llama_cpp:
        matched = pair_rows(summary, rows)
        ratios.update({f"{m['run']}/{m['peer_run']} {phase}": m[f"{phase}_ratio"] for m in matched
                       for phase in ("prefill", "decode") if f"{phase}_ratio" in m})
    from kernels import kernel_variant
    from kernels.build import load
    from kernels.cpu_features import detect

    lib = load(kernel_variant())
    info.update(cpu=detect().summary(), cpu_model=detect().model, kernel_variant=kernel_variant(),
                simd_path=lib.moegate_simd_path().decode() if lib is not None else None)
    if peer_info:
        peer_info["cpu_info"] = next((r["llama_bench"][0]["cpu"] for r in runs.values() if "llama_bench" in r), None)
    result = {"model": model, "prompt_len": args.prompt_len, "decode": args.decode, "threads": threads,
              "dense_dtype": args.dense, "machine": info, "llama_cpp": peer_info, "compare_rev": args.compare_rev,
              "repeats": args.repeats, "runs": runs, "median": summary, "ratios": ratios, "matched": matched,
              "busy_after": machine_info()["cpu_busy_fraction"], "loadavg_after": os.getloadavg()}
    (out / "engine_bench.json").write_text(json.dumps(result, indent=2))
    _plot(out / "engine_bench.png", summary, matched)
    print(f"machine: {info['cpu_model']} ({info['cpu']}), moegate kernel {info['kernel_variant']}: {info['simd_path']}; "
          f"load average {info['loadavg']} before, {result['loadavg_after']} after")
    if matched:
        print(format_matched(matched))
    print(json.dumps(ratios, indent=2))
    return result


def _matched_rows(ap: argparse.ArgumentParser, args) -> tuple:
    """The MATCHED rows --peers keeps (all without it)."""
    if args.peers is None:
        return MATCHED
    rows = tuple(r for r in MATCHED if r.peer in args.peers.split(","))
    if not args.llama_cpp or {r.peer for r in rows} != set(args.peers.split(",")):
        ap.error(f"--peers takes --llama-cpp and names among {', '.join(dict.fromkeys(r.peer for r in MATCHED))}")
    return rows


def _format_plan(args, model: str, prompt: list[int], pack: str) -> list[tuple]:
    """The per-format plan: the default profile per --formats, the +fast runs per --lm-head, --compare-rev."""
    plan = [(f"moegate-{f}", _moegate, (model, f, args.dense, prompt, args.decode), {"pack_dir": pack})
            for f in args.formats.split(",") if not args.fast_only]

    def attn(f: str) -> str:
        return f if args.fast_dense == "match" else args.fast_dense

    def head(f: str, h: str) -> str:
        return f if h == "match" else h

    plan += [(f"moegate-{f}+fast-lmhead-{head(f, h)}-attn-{attn(f)}", _moegate,
              (model, f, args.dense, prompt, args.decode), {"pack_dir": pack, "lm_head": head(f, h), "fast_dense": attn(f)})
             for f in args.formats.split(",") for h in args.lm_head.split(",") if h]
    if args.compare_rev:  # each moegate run beside the same run on the earlier kernel, alternating
        from evals.perf.kernel_baselines import kernel_source_at

        old = str(kernel_source_at(args.compare_rev))
        plan = [p for name, fn, fa, kw in plan
                for p in ((name, fn, fa, kw), (f"{name}@{args.compare_rev}", fn, fa, {**kw, "kernel_source": old}))]
    return plan


def _run_plan(plan: list[tuple]) -> dict[str, dict]:
    """Each run in a fresh process: a run must not inherit the previous one's heap, thread pools or page
    cache state (in one process a third engine decoded ~40% slower than the same engine run first).
    moegate's runs get the OpenMP settings `import engine` makes before torch loads (engine.OPENMP_ENV);
    the baselines (transformers, llama-bench) run with the environment as it was."""
    from engine import OPENMP_ENV, USER_OPENMP_ENV

    runs: dict[str, dict] = {}
    spawn = multiprocessing.get_context("spawn")
    for name, fn, fargs, fkw in tqdm(plan, desc="engine bench"):
        ours = fn in (_moegate, _moegate_execution)
        for key, value in OPENMP_ENV.items():
            chosen = (USER_OPENMP_ENV[key] or value) if ours else USER_OPENMP_ENV[key]
            if chosen is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = chosen
        try:
            with spawn.Pool(1) as pool:
                runs[name] = pool.apply(fn, fargs, fkw)
        except ImportError as exc:
            runs[name] = {"skipped": str(exc)}
        tqdm.write(f"{name}: {_brief(runs[name])}")
    return runs


def _brief(run: dict) -> str:
    return ", ".join(f"{k} {run[k]:.1f}" for k in ("prefill_tok_s", "decode_tok_s") if k in run) or str(run)


def _ratios(summary: dict[str, dict], compare_rev: str | None) -> dict[str, float]:
    ratios = {}
    if compare_rev:  # this kernel / the earlier revision's, same configuration, alternating processes
        for name, r in summary.items():
            old = summary.get(f"{name}@{compare_rev}", {})
            if "decode_tok_s" in r and "decode_tok_s" in old:
                ratios[f"{name}/@{compare_rev} decode"] = r["decode_tok_s"] / old["decode_tok_s"]
                ratios[f"{name}/@{compare_rev} prefill"] = r["prefill_tok_s"] / old["prefill_tok_s"]
    base = summary.get("transformers-eager-bf16", {})
    for name, r in summary.items():
        if name.startswith("moegate") and "decode_tok_s" in base and "decode_tok_s" in r:
            ratios[f"{name}/transformers-bf16 decode"] = r["decode_tok_s"] / base["decode_tok_s"]
            ratios[f"{name}/transformers-bf16 prefill"] = r["prefill_tok_s"] / base["prefill_tok_s"]
    return ratios


def _plot(path: Path, summary: dict[str, dict], matched: list[dict] | None) -> None:
    ok = {k: v for k, v in summary.items() if "decode_tok_s" in v}
    groups = {"prefill tok/s": {k: v["prefill_tok_s"] for k, v in ok.items()},
              "decode tok/s": {k: v["decode_tok_s"] for k, v in ok.items()}}
    if matched:
        measured = [m for m in matched if "decode_ratio" in m]
        for phase in ("prefill", "decode"):
            groups[f"{phase} moegate / llama.cpp"] = {f"{m['run'].removeprefix('moegate-')} vs {m['peer']}":
                                                      m[f"{phase}_ratio"] for m in measured}
    save_bar_plot(path, "end-to-end tok/s (higher is better)", groups)


def median_runs(runs: dict[str, dict]) -> dict[str, dict]:
    """Runs "name#r" of --repeats folded into "name": the median of each figure, the first run's facts
    (precision, the peer's tensor types)."""
    import statistics

    groups: dict[str, list[dict]] = {}
    for name, r in runs.items():
        groups.setdefault(name.split("#")[0], []).append(r)
    out = {}
    for name, rs in groups.items():
        ok = [r for r in rs if "decode_tok_s" in r]
        if not ok:
            out[name] = rs[0]
            continue
        out[name] = {**ok[0], **{k: statistics.median(r[k] for r in ok) for k in ("prefill_tok_s", "decode_tok_s")}}
        steps = [r["decode_step_ms"] for r in ok if r.get("decode_step_ms")]
        if steps:
            out[name]["decode_step_ms"] = {k: statistics.median(s[k] for s in steps) for k in steps[0]}
    return out


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
