"""Constrained-decoding overhead measured in the real engine: decode-step time with and without a
constraint (JSON Schema or schema-derived SQL) on the same model, prompts and budgets, at batch sizes 1
and 8, requests interleaved so load drifts cancel; plus the cold compile time of each constraint.

The constraint's work per step is the token advance, the mask fill (llguidance, then the SQL scope
guard), the closing planner's occasional search and the mask apply (compiled kernel); all of it runs
inside `engine.step()`, so the difference of median decode-step times is the whole overhead a user
pays. The masks go through the gateway's batched path (`BatchMasker`, one fill call per step for every
constrained row), whose fill time is also timed directly per step (`mask_ms_*`, its share of the
unconstrained step: `mask_pct_*`).

Each constrained batch runs twice per proxy: with every step's full mask, and with lazy verification (the
sampler checks a row's best candidates one by one, `Constraint.first_allowed`, and fills the full mask only
where none is ruled on); the constraint work per step (fills, lazy checks) is timed directly, lazy's hit rate
counted, and the outputs of the two compared. Two proxies: the reference model as it is (random: its
logits put almost no mass on valid tokens) and a "competent model" (the same logits plus `--boost` on the
gold next token, evals/structured/gold_replay.py).

`--compare-rev REV` runs the same measurement with REV's `gateway/` (exported by `git archive`, the
engine and this eval unchanged) and then with the working tree's, one after the other in this run,
each in its own process: before and after, on one machine under the same load.

    PYTHONPATH=. python -m evals.structured.engine_overhead [--kinds sql,json] [--batch-sizes 1,8]
        [--boost 30] [--compare-rev 779d68a] [--name engine_overhead]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from evals.perf.common import machine_info, save_bar_plot

DEFAULT_MODEL = Path("evals/out/models/bench-ref")  # engine_bench's reference model (Qwen vocabulary)
DEMO_MODEL = Path("engine/assets/demo-moe")
SCHEMAS = Path("/work/shared/evaldata/jsonschemabench/Glaiveai2K.jsonl")
SPIDER = Path("/work/shared/evaldata/sql")
PROMPTS = {"json": "Reply with the JSON object for today's order ticket.",
           "sql": "Which singer had the most concerts last year? Reply with one SQL query."}


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def _decode_steps(engine, requests: list[tuple[str, list[int], object]], mode: str,
                  timed: bool = False) -> tuple[list[float], list[float], dict[str, list[int]]]:
    """Seconds of each engine step that decodes every request of the batch at once (not the prefill
    step, not the tail after one finished), the constraint work (`SPENT`: mask fills, lazy checks) in each
    when `timed`, and each request's output ids."""
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params, mode=mode)
    times, masks, first, outputs = [], [], True, {}
    while engine.has_work():
        full = len(engine.scheduler.running) == len(requests) and not engine.scheduler.waiting
        spent = SPENT["s"]
        t0 = time.perf_counter()
        finished = [o for o in engine.step() if o.finished]
        if full and not first:
            times.append(time.perf_counter() - t0)
            masks.append(SPENT["s"] - spent if timed else 0.0)
        outputs.update({o.request_id: list(o.token_ids) for o in finished})
        first = False
    return times, masks, outputs


def _specs(kind: str, n: int, compile_n: int, info, cache) -> tuple[list, list[float]]:
    """`n` (constraint spec, gold ids) pairs of `kind` (JSON: the first compilable Glaive schemas, each with
    an instance; SQL: Spider databases' schemas, SQLite, each with its first gold query; only those whose gold
    the constraint accepts) and the cold compile seconds of at least `compile_n` specs (spec built + compiled; the process's
    one-time setup, the tokenizer's tables, is paid by a first compile not counted)."""
    from evals.structured.gold_replay import accepted_ids, json_texts, spider_gold
    from gateway.structured.build import build_constraint, json_schema_spec
    from gateway.structured.errors import StructuredOutputError

    specs, seconds = [], []
    if kind == "json":
        rows = [json.loads(line)["schema"] for line in open(SCHEMAS)]
        sources = ((lambda r=r: json_schema_spec(r), json_texts(r) if isinstance(r, dict) else []) for r in rows)
    else:
        from gateway.structured.sql_grammar import sql_spec
        from gateway.structured.sql_schema import DatabaseSchema, SQLPolicy

        tables = json.load(open(SPIDER / "spider_tables.json"))
        gold = spider_gold(json.load(open(SPIDER / "spider_dev.json")))
        sources = ((lambda t=t: sql_spec(DatabaseSchema.from_spider(t), SQLPolicy(dialect="sqlite")),
                    gold.get(t["db_id"], [])[:1]) for t in tables)
    from gateway.structured.cache import CompileConfig, ConstraintCache
    from gateway.structured.errors import ConstraintCompileTimeout

    _ = info.llg  # the tokenizer's llguidance tables: once per process, not per compile
    first = next(sources)
    build_constraint(first[0](), info, cache=ConstraintCache(CompileConfig(timeout_s=600)))  # (again below, counted)
    for make, texts in [first, *sources]:
        t0 = time.perf_counter()
        try:
            spec = make()
            constraint = build_constraint(spec, info, cache=cache)
        except ConstraintCompileTimeout:  # past the gateway's bound: counted at its time, not decoded
            seconds.append(time.perf_counter() - t0)
            continue
        except StructuredOutputError:
            continue
        seconds.append(time.perf_counter() - t0)
        if len(specs) < n and (gold := accepted_ids(constraint, info, texts)) is not None:
            specs.append((spec, gold))
        if len(specs) == n and len(seconds) >= compile_n:
            break
    return specs, seconds


SPENT = {"s": 0.0}  # seconds of constraint work in the sampler: mask fills (BatchMasker.fill), lazy checks


def _timed_masker(lazy: bool):
    """The gateway's BatchMasker (lazy verification on or off) adding the seconds its `fill` calls take to
    SPENT; the sampler's lazy checks (engine.sampler._lazy_rows: ranking, first_allowed) add theirs too."""
    import engine.sampler as sampler
    from gateway.structured import batch

    if not getattr(sampler._lazy_rows, "timed", False):
        lazy_rows = sampler._lazy_rows

        def timed_lazy_rows(*args):
            t0 = time.perf_counter()
            try:
                return lazy_rows(*args)
            finally:
                SPENT["s"] += time.perf_counter() - t0
        timed_lazy_rows.timed = True
        sampler._lazy_rows = timed_lazy_rows

    class TimedMasker(batch.BatchMasker):
        def fill(self, constraints, bitmask) -> None:
            t0 = time.perf_counter()
            super().fill(constraints, bitmask)
            SPENT["s"] += time.perf_counter() - t0

    return TimedMasker(prefetch=False, **({"lazy_candidates": batch.LAZY_CANDIDATES if lazy else 0}
                                          if hasattr(batch, "LAZY_CANDIDATES") else {}))


def _summary(none: list[float], steps: list[float], masks: list[float], constraints: list) -> dict:
    """One masking's figures against the unconstrained steps of the same batches."""
    base_p50, base_mean = statistics.median(none) * 1e3, statistics.fmean(none) * 1e3
    p50, mean = statistics.median(steps) * 1e3, statistics.fmean(steps) * 1e3
    mask_p50, mask_mean = statistics.median(masks) * 1e3, statistics.fmean(masks) * 1e3
    hits = sum(getattr(c, "lazy_hits", 0) for c in constraints)
    fallbacks = sum(getattr(c, "lazy_fallbacks", 0) for c in constraints)
    return {"decode_steps": len(steps), "step_ms_p50_constrained": p50, "step_ms_mean_constrained": mean,
            "overhead_pct": 100 * (p50 / base_p50 - 1), "overhead_mean_pct": 100 * (mean / base_mean - 1),
            "mask_ms_p50": mask_p50, "mask_ms_mean": mask_mean,
            "mask_pct_p50": 100 * mask_p50 / base_p50, "mask_pct_mean": 100 * mask_mean / base_mean,
            "lazy_hits": hits, "lazy_fallbacks": fallbacks,
            "lazy_candidates_checked": sum(getattr(c, "lazy_checked", 0) for c in constraints),
            "lazy_hit_rate": hits / (hits + fallbacks) if hits + fallbacks else None,
            # the closing planner over every step: completion searches, checks answered by the last path, seconds
            "plan_searches": sum(getattr(c, "plan_searches", 0) for c in constraints),
            "plan_reuses": sum(getattr(c, "plan_reuses", 0) for c in constraints),
            "plan_search_s": sum(getattr(c, "plan_search_s", 0.0) for c in constraints),
            "accepted": sum(c.is_accepting() for c in constraints), "requests": len(constraints)}


def _maskings() -> tuple[str, ...]:
    """full (every step's mask), and lazy where the gateway under test has it (a --compare-rev base may not)."""
    from gateway.structured import batch

    return ("full", "lazy") if hasattr(batch, "LAZY_CANDIDATES") else ("full",)


def measure(model: Path, kinds: tuple[str, ...], requests: int, batch_sizes: tuple[int, ...], max_tokens: int,
            modes: tuple[str, ...], fmt: str, lm_head: str, dense: str, compile_n: int, boost: float) -> dict:
    """Per kind, mode and batch size: unconstrained steps, and per proxy (the reference model as is; with the
    gold next token boosted) and masking (full / lazy) the constrained steps, constraint work per step, lazy
    hit rate and whether lazy's outputs equal full masking's."""
    from engine.experts import PlacementConfig
    from engine.llm_engine import LLM
    from engine.sampling_params import SamplingParams
    from evals.structured.gold_replay import boosted
    from gateway.structured import closing as closing_mod
    from gateway.structured.build import build_constraint
    from gateway.structured.cache import ConstraintCache
    from gateway.structured.vocab import TokenizerInfo

    llm = LLM(str(model), placement=PlacementConfig(fast_format=fmt, exact_format=fmt), prefix_cache=False,
              fast_lm_head=lm_head, fast_dense=dense, progress=False)
    engine, tok = llm.engine, llm.tokenizer
    eos = tuple(tok.eos_token_ids)
    info = TokenizerInfo.from_file(str(model / "tokenizer.json"), eos)
    maskers = {m: _timed_masker(m == "lazy") for m in _maskings()}
    warm = tok.encode("warm")
    _decode_steps(engine, [("warm", warm, SamplingParams(max_tokens=4))], modes[0])  # kernel build, first touch
    out: dict = {}
    for kind in kinds:
        cache = ConstraintCache()
        specs, compile_s = _specs(kind, requests, compile_n, info, cache)
        out[kind] = {"compile": {"n": len(compile_s), "ms_p50": 1e3 * _percentile(compile_s, 0.5),
                                 "ms_p99": 1e3 * _percentile(compile_s, 0.99), "ms_max": 1e3 * max(compile_s)}}
        print(kind, "compile", out[kind]["compile"], "requests with an accepted gold", len(specs))
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPTS[kind]}]))
        for mode in modes if kind == "json" else ("execution",):  # SQL is decoded in execution mode
            for bs in batch_sizes:
                runs = [("none", None, None)] + [(p, m, maskers[m]) for p in ("random", "competent") for m in maskers]
                steps: dict[tuple, list[float]] = {(p, m): [] for p, m, _ in runs}
                masks: dict[tuple, list[float]] = {(p, m): [] for p, m, _ in runs}
                made: dict[tuple, list] = {(p, m): [] for p, m, _ in runs}
                outputs: dict[tuple, list] = {(p, m): [] for p, m, _ in runs}
                batches = [specs[i:i + bs] for i in range(0, len(specs) - bs + 1, bs)] or [specs[:bs]]
                for i, batch in enumerate(tqdm(batches, desc=f"{kind} {mode} x{bs}")):
                    for proxy, masking, masker in runs if i % 2 == 0 else runs[::-1]:  # alternate: drift cancels
                        name = f"{kind}-{mode}-{bs}-{proxy}-{masking}-{i}"
                        if masker is None:
                            reqs = [(f"{name}-{j}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
                                    for j in range(len(batch))]
                        else:
                            cons = [build_constraint(spec, info, eos_ids=eos, cache=cache, max_tokens=max_tokens,
                                                     mask_batcher=masker) for spec, _ in batch]
                            made[proxy, masking] += cons
                            reqs = [(f"{name}-{j}", prompt, SamplingParams(max_tokens=max_tokens, logits_processors=[c]))
                                    for j, c in enumerate(cons)]
                        if hasattr(closing_mod, "drop_shared_paths"):  # (every run finds its own completion
                            closing_mod.drop_shared_paths()  # paths, the start states' aside)
                        gold = {f"{name}-{j}": ids for j, (_, ids) in enumerate(batch)} if proxy == "competent" else {}
                        with boosted(gold, boost):
                            times, spent, done = _decode_steps(engine, reqs, mode, timed=masker is not None)
                        steps[proxy, masking] += times
                        masks[proxy, masking] += spent
                        outputs[proxy, masking] += [done[r] for r, _, _ in reqs]
                row = out[kind].setdefault(mode, {})[f"batch_{bs}"] = {
                    "step_ms_p50_unconstrained": statistics.median(steps["none", None]) * 1e3,
                    "step_ms_mean_unconstrained": statistics.fmean(steps["none", None]) * 1e3}
                for proxy, masking, _ in runs[1:]:
                    row.setdefault(proxy, {})[masking] = _summary(
                        steps["none", None], steps[proxy, masking], masks[proxy, masking], made[proxy, masking])
                    if masking == "lazy":
                        row[proxy]["identical_outputs"] = outputs[proxy, "lazy"] == outputs[proxy, "full"]
                print(kind, mode, bs, json.dumps(row, indent=1))
    engine.runner.shutdown()
    for masker in maskers.values():
        masker.close()
    return out


def _export(rev: str) -> Path:
    """REV's gateway/ package in a temporary directory (first on PYTHONPATH, it shadows the tree's)."""
    root = Path(tempfile.mkdtemp(prefix="overhead-rev-"))
    archive = subprocess.run(["git", "archive", rev, "gateway"], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=__import__("io").BytesIO(archive)) as tar:
        tar.extractall(root, filter="data")
    return root


def _compare(args, argv: list[str]) -> dict:
    """Each revision in its own process (base first, then the working tree), same arguments."""
    out = {}
    for label, path in ((f"base {args.compare_rev}", _export(args.compare_rev)), ("head", None)):
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(
                [str(path)] * (path is not None) + [os.getcwd(), os.environ.get("PYTHONPATH", "")]))
            # -P: no working directory ahead of PYTHONPATH (`-m` puts it first, and its gateway/ would shadow REV's)
            cmd = [sys.executable, "-P", "-m", "evals.structured.engine_overhead", *argv, "--worker-out", f.name]
            print(label, "...", flush=True)
            subprocess.run(cmd, check=True, env=env)
            out[label] = json.loads(Path(f.name).read_text())
    return out


def _plot(path: Path, revisions: dict) -> None:
    """One panel per kind, mode and batch size: each revision's unconstrained step p50 and, per proxy and
    masking, the constrained step p50 and the constraint work per step p50."""
    groups: dict[str, dict[str, float]] = {}
    for label, kinds in revisions.items():
        for kind, modes in kinds.items():
            for mode, batches in modes.items():
                for batch, r in batches.items() if mode != "compile" else ():
                    g = groups.setdefault(f"{kind} {mode} {batch.replace('_', ' ')} (ms)", {})
                    g[f"{label}: unconstrained"] = r["step_ms_p50_unconstrained"]
                    for proxy in ("random", "competent"):
                        for masking, m in r[proxy].items() if proxy in r else ():
                            if isinstance(m, dict):
                                g[f"{label}: {proxy} {masking} step"] = m["step_ms_p50_constrained"]
                                g[f"{label}: {proxy} {masking} mask"] = m["mask_ms_p50"]
    save_bar_plot(path, "decode step p50 and constraint work p50 per step (full mask vs lazy)", groups)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL if DEFAULT_MODEL.exists() else DEMO_MODEL)
    p.add_argument("--kinds", default="sql,json")
    p.add_argument("--requests", type=int, default=16, help="constraints per kind (JSON: Glaive schemas; SQL: Spider DBs)")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--compile-n", type=int, default=60, help="schemas / databases whose cold compile is timed")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--modes", default="execution,exploration", help="JSON's modes (SQL runs in execution)")
    p.add_argument("--format", default="int4", help="expert format of the engine (fast and exact)")
    p.add_argument("--lm-head", default="int4", help="exploration lm_head format (engine_bench's best config)")
    p.add_argument("--fast-dense", default="int8", help="exploration attention format")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--boost", type=float, default=30.0, help="logit added to the gold next token (competent proxy)")
    p.add_argument("--compare-rev", default=None, help="git revision whose gateway/ runs first, as the baseline")
    p.add_argument("--worker-out", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=Path("evals/structured/results"))
    p.add_argument("--name", default="engine_overhead", help="file name (without .json / .png) under --out")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = {"model": str(args.model), "requests": args.requests, "max_tokens": args.max_tokens, "boost": args.boost,
              "batch_sizes": args.batch_sizes, "format": args.format, "lm_head": args.lm_head,
              "fast_dense": args.fast_dense, "machine": machine_info()}
    if args.compare_rev is not None and args.worker_out is None:
        worker_argv = [a for i, a in enumerate(argv) if a != "--compare-rev" and argv[i - 1:i] != ["--compare-rev"]
                       and not a.startswith("--compare-rev=")]
        result["revisions"] = _compare(args, worker_argv)
    else:
        result["revisions"] = {"head": measure(
            args.model, tuple(args.kinds.split(",")), args.requests, tuple(int(b) for b in args.batch_sizes.split(",")),
            args.max_tokens, tuple(args.modes.split(",")), args.format, args.lm_head, args.fast_dense, args.compile_n,
            args.boost)}
    result["machine_after"] = machine_info()
    if args.worker_out is not None:
        args.worker_out.write_text(json.dumps(result["revisions"]["head"]))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=2))
    _plot(args.out / f"{args.name}.png", result["revisions"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
