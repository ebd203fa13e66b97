"""Multi-token decoding benchmark: jump-forward on constrained output, prompt-lookup speculation on echo tasks.

1. Jump-forward (engine API, demo model, the dev policy's numerics, greedy): the finance report schemas and
   tool calls (evals/demo/schemas.py) and the first JSONSchemaBench schemas of each split, run with
   `jump_forward_tokens` 0 (baseline) and 32 in the same process. Reports the forced-token share, forwards
   per output token and tok/s as ratios, and checks the outputs are the same bytes.
2. Speculation (engine API, greedy): an echo task (copy a table / a JSON record list), whose output repeats
   its prompt, which is where n-gram drafts pay. `speculative_tokens` 0 (baseline) against 2 and 4 on the demo
   model (exploration and execution) and, with --bench-model, on the random bench checkpoint (`moegate model
   init-random --preset bench`: random weights rarely copy, so its acceptance is a floor, not a forecast).
3. MTP drafts (--mtp-model LABEL=DIR, repeatable; --mtp-only skips 1 and 2): `speculative_source` "mtp" with
   `speculative_tokens` 0 (baseline), 1 and 2 on a DeepSeek-V3 / GLM-4.5 checkpoint with a multi-token-prediction
   layer (`modeltools.mtp_checkpoint.add_mtp_layer`: a random one, or `mirror=True`, whose drafts are the main
   model's direct-path predictions), exploration and execution, the same echo prompts.

    python -m evals.perf.multi_token_bench [--bench-model DIR] [--mtp-model LABEL=DIR ...] [--mtp-only]
        [--out evals/perf/results]

Writes multi_token_bench.json and .png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from evals.perf.common import machine_info, save_bar_plot

DEMO = Path(__file__).resolve().parents[2] / "engine" / "assets" / "demo-moe"
EVALDATA = Path("/work/shared/evaldata/jsonschemabench")
SPLITS = ("Github_easy", "Glaiveai2K", "Snowplow")
ROWS = [("AAPL", "187.25", 150, "buy"), ("MSFT", "402.10", 20, "sell"), ("NVDA", "903.50", 75, "buy"),
        ("AMZN", "178.90", 40, "buy"), ("JPM", "196.30", 310, "sell"), ("XOM", "117.80", 55, "buy")]


def _engine(model: Path, **kw):
    from engine.engine_config import EngineConfig
    from engine.llm_engine import LLMEngine
    from gateway.app import DEV_POLICY, numerics_from_policy
    from policies.loader import load_policy

    numerics = numerics_from_policy(load_policy(DEV_POLICY))
    return LLMEngine(EngineConfig(model=str(model), numerics=numerics, prefix_cache=False, progress=False,
                                  kv_cache_gib=0.25, **kw))


def _warm(engine) -> None:
    """One short request first: kernel builds and first-call costs stay out of the timed runs."""
    from engine.sampling_params import SamplingParams

    _drive(engine, [("warm", engine.tokenizer.encode("warm up the engine"), SamplingParams(max_tokens=8), "execution")])


def _drive(engine, requests) -> tuple[dict[str, list[int]], float, int]:
    """Runs (id, prompt, params, mode) one at a time -> ({id: tokens}, decode seconds, decode steps): from the
    step that gave a request its first token (the prefill) to its end."""
    out, seconds, steps = {}, 0.0, 0
    for rid, prompt, params, mode in requests:
        engine.add_request(rid, prompt, params, mode=mode)
        first = None
        while engine.has_work():
            out.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
            if first is None:
                first = time.perf_counter()
            else:
                steps += 1
        seconds += time.perf_counter() - first
    return out, seconds, steps


def constrained_tasks(schemas_per_split: int) -> dict[str, list[tuple[str, dict]]]:
    """{workload: [(name, spec source)]}: finance report schemas and tool calls, JSONSchemaBench heads."""
    from evals.demo.schemas import REPORT_SCHEMAS, TOOLS

    tasks = {"finance_json": [(n, {"schema": s}) for n, s in REPORT_SCHEMAS.items()],
             "finance_tools": [(n, {"tools": [t]}) for n, t in TOOLS.items()]}
    for split in SPLITS:
        path = EVALDATA / f"{split}.jsonl"
        if path.is_file():
            lines = path.read_text().splitlines()[:schemas_per_split]
            rows = [json.loads(x)["schema"] for x in lines]
            tasks[split] = [(f"{split}-{i}", {"schema": json.loads(s) if isinstance(s, str) else s})
                            for i, s in enumerate(rows)]
    return tasks


def _requests(engine, tok, tasks, max_tokens: int):
    from engine.sampling_params import SamplingParams
    from gateway.structured.batch import default_masker
    from gateway.structured.build import build_constraint, json_schema_spec
    from gateway.structured.tools import tool_call_spec

    out = []
    for name, task in tasks:
        try:
            spec = (tool_call_spec(task["tools"], tok, "required") if "tools" in task
                    else json_schema_spec(task["schema"]))
            c = build_constraint(spec, tok, max_tokens=max_tokens, mask_batcher=default_masker())
        except Exception:  # noqa: BLE001 - a schema the constraint backend rejects is left out of the run
            continue
        what = "Call the tool." if "tools" in task else f"Answer in JSON ({name})."
        prompt = engine.tokenizer.encode_chat([{"role": "user", "content": what}], tools=task.get("tools"))
        out.append((name, prompt, SamplingParams(max_tokens=max_tokens, logits_processors=[c]), "execution"))
    return out


def jump_forward(schemas_per_split: int, max_tokens: int) -> dict:
    from gateway.structured.vocab import TokenizerInfo

    engines = {jf: _engine(DEMO, jump_forward_tokens=jf) for jf in (0, 32)}
    for engine in engines.values():
        _warm(engine)
    tok = TokenizerInfo.from_file(DEMO / "tokenizer.json", sorted(engines[0].eos_token_ids))
    results = {}
    for workload, tasks in constrained_tasks(schemas_per_split).items():
        runs = {}
        for jf, engine in engines.items():
            before = dict(engine.decoder.stats.as_dict())
            tokens, seconds, steps = _drive(engine, _requests(engine, tok, tasks, max_tokens))
            stats = {k: v - before[k] for k, v in engine.decoder.stats.as_dict().items()}
            n = sum(len(t) for t in tokens.values())
            runs[jf] = {"tokens": tokens, "seconds": seconds, "steps": steps, "output_tokens": n,
                        "forced_tokens": stats["forced_tokens"], "tok_s": (n - len(tokens)) / seconds}
        base, jf = runs[0], runs[32]
        results[workload] = {
            "requests": len(base["tokens"]), "output_tokens": base["output_tokens"],
            "forced_share": jf["forced_tokens"] / max(jf["output_tokens"], 1),
            "steps_baseline": base["steps"], "steps_jump_forward": jf["steps"],
            "tok_s_baseline": round(base["tok_s"], 1), "tok_s_jump_forward": round(jf["tok_s"], 1),
            "speedup": round(jf["tok_s"] / base["tok_s"], 3),
            "same_bytes": base["tokens"] == jf["tokens"],
        }
        print(workload, {k: v for k, v in results[workload].items()})
    return results


def echo_prompt(tokenizer) -> list[int]:
    table = "\n".join(f"| {s} | {p} | {q} | {side} |" for s, p, q, side in ROWS)
    records = json.dumps([{"symbol": s, "price": float(p), "quantity": q, "side": side} for s, p, q, side in ROWS])
    text = f"Copy the table, then the JSON records, exactly.\n{table}\n{records}"
    return tokenizer.encode_chat([{"role": "user", "content": text}])


def speculation(model: Path, label: str, modes: tuple[str, ...], max_tokens: int, ks=(0, 2, 4),
                source: str = "ngram", repeats: int = 1) -> dict:
    """Per mode, `repeats` rounds of every k in turn (alternating, in one process); tok_s is the rounds' median,
    every round's kept in `tok_s_repeats`, speedup the median of each round's ratio to k=0 (`speedup_repeats`)."""
    from engine.sampling_params import SamplingParams

    results = {}
    engines = {k: _engine(model, speculative_tokens=k, jump_forward_tokens=0, speculative_source=source) for k in ks}
    for engine in engines.values():
        _warm(engine)
    prompt = echo_prompt(engines[ks[0]].tokenizer)
    for mode in modes:
        reqs = [(f"{mode}-{i}", prompt[i:], SamplingParams(max_tokens=max_tokens, ignore_eos=True), mode)
                for i in range(3)]
        rows, base = {k: None for k in ks}, None
        for _ in range(repeats):
            first = None
            for k, engine in engines.items():
                before = dict(engine.decoder.stats.as_dict())
                tokens, seconds, steps = _drive(engine, reqs)
                stats = {key: v - before[key] for key, v in engine.decoder.stats.as_dict().items()}
                n = sum(len(t) for t in tokens.values())
                decoded = n - len(tokens)  # the first token of each came with its prefill
                tok_s = decoded / seconds
                if base is None:
                    base = tokens
                if first is None:
                    first = tok_s
                row = rows[k] = rows[k] or {
                    "tokens_per_step": round(decoded / max(steps, 1), 3),
                    "acceptance": round(stats["accepted_tokens"] / max(stats["drafted_tokens"], 1), 3),
                    "drafted": stats["drafted_tokens"], "accepted": stats["accepted_tokens"],
                    "distinct_output_tokens": len({t for ids in tokens.values() for t in ids}),
                    "same_tokens_as_baseline": True, "tok_s_repeats": [], "speedup_repeats": []}
                row["tok_s_repeats"].append(round(tok_s, 1))
                row["speedup_repeats"].append(round(tok_s / first, 3))
                row["same_tokens_as_baseline"] &= tokens == base
        for k, row in rows.items():
            row["tok_s"] = statistics.median(row["tok_s_repeats"])
            row["speedup"] = statistics.median(row["speedup_repeats"])
            results[f"{label}/{mode}/k={k}"] = row
            print(label, mode, k, row)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench-model", help="random bench checkpoint (moegate model init-random --preset bench)")
    ap.add_argument("--schemas-per-split", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--mtp-model", action="append", default=[], metavar="LABEL=DIR",
                    help="checkpoint with an MTP layer, drafts from it (repeatable)")
    ap.add_argument("--mtp-only", action="store_true", help="only the MTP runs (writes multi_token_bench_mtp.json)")
    ap.add_argument("--repeats", type=int, default=1, help="alternating rounds of the MTP runs")
    ap.add_argument("--out", default="evals/perf/results")
    args = ap.parse_args()
    machine = machine_info()
    print(machine)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mtp = {}
    for spec in args.mtp_model:
        label, _, path = spec.partition("=")
        mtp.update(speculation(Path(path), f"mtp-{label}", ("exploration", "execution"), args.max_tokens, (0, 1, 2),
                               source="mtp", repeats=args.repeats))
    if args.mtp_only:
        (out / "multi_token_bench_mtp.json").write_text(json.dumps({"machine": machine, "mtp": mtp}, indent=2))
        print(f"wrote {out / 'multi_token_bench_mtp.json'}")
        return
    report = {"machine": machine, "jump_forward": jump_forward(args.schemas_per_split, args.max_tokens),
              "speculation": speculation(DEMO, "demo", ("exploration", "execution"), args.max_tokens)}
    if args.bench_model:
        report["speculation"].update(speculation(Path(args.bench_model), "bench", ("exploration",), 64, (0, 4)))
    report["speculation"].update(mtp)
    (out / "multi_token_bench.json").write_text(json.dumps(report, indent=2))
    jf = report["jump_forward"]
    save_bar_plot(out / "multi_token_bench.png", f"multi-token decoding ({machine['cpu'][:40]})", {
        "jump-forward: forced-token share": {w: r["forced_share"] for w, r in jf.items()},
        "jump-forward: tok/s vs baseline": {w: r["speedup"] for w, r in jf.items()},
        "speculation: tok/s vs k=0": {k: r["speedup"] for k, r in report["speculation"].items()},
        "speculation: acceptance": {k: r["acceptance"] for k, r in report["speculation"].items() if "k=0" not in k},
    })
    print(f"wrote {out / 'multi_token_bench.json'}")


if __name__ == "__main__":
    main()
