"""`moegate eval`: runs the quality and performance suites on a model and writes a markdown report + PNGs.

Sections: constrained tool calls / JSON / SQL on held-out tasks (validity and semantic accuracy),
execution-mode determinism, quantization error of each expert format vs bf16 (KL, top-1), routing skew
per layer and what it means for `uniform` vs `frequency` hot-expert placement, deferral speed and
drift (evals/perf/modes_bench.py), the gateway's constraints on JSONSchemaBench, Spider and BFCL
(evals/structured, sampled), and the speed figures of the other benchmarks found under --out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

DEMO = Path(__file__).resolve().parents[1] / "engine" / "assets" / "demo-moe"
SQL_FENCE_OPEN = "```sql\n"


def _llm(model: str, fmt: str = "bf16", **kw):
    from engine.experts import PlacementConfig
    from engine.llm_engine import LLM

    return LLM(model, placement=PlacementConfig(fast_format=fmt, exact_format=fmt), progress=False, **kw)


def structured_tasks(model: str, n: int, exclude: frozenset[str] = frozenset(), tasks: list | None = None) -> dict:
    """Held-out tool-call, JSON and SQL tasks decoded under their constraints in execution mode.

    Per kind: `n`, `valid` (passes the gateway's validator), `correct` (exactly the expected call / object /
    result rows) and `field_hits` of `fields`: expected argument or JSON leaf fields reproduced exactly at
    their path, or for SQL the reference query's literals found in the output (partial copying shows here);
    for tool calls and JSON, `missed_fields` counts the expected fields got wrong, by path.
    `exclude`: rendered conversations to skip (those a model trained on, for tasks it never saw verbatim).
    `tasks`: these tasks instead (e.g. `adhoc_heldout_tasks`); a SQL task with `tables` runs on those tables.
    """
    from evals.demo.adhoc import query_db
    from evals.demo.corpus import create_trading_db, heldout_tasks, wants_fenced_sql
    from evals.structured_score import field_matches, missed_fields, sql_literal_matches
    from gateway.structured import build as sb
    from gateway.structured.segment import segment_body, segment_spec
    from gateway.structured.sql_grammar import sql_spec
    from gateway.structured.sql_schema import DatabaseSchema
    from gateway.structured.tools import tool_call_spec
    from gateway.structured.validate import validate_json, validate_sql, validate_tool_calls
    from gateway.structured.vocab import TokenizerInfo

    llm = _llm(model)
    tok = llm.tokenizer
    eos = tuple(tok.eos_token_ids)
    info = TokenizerInfo.from_file(str(Path(model) / "tokenizer.json"), eos)
    db = create_trading_db()
    tables = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
    trading_schema = DatabaseSchema.from_mapping({t: [c[1] for c in db.execute(f"PRAGMA table_info({t})")]
                                                  for t in tables})
    out: dict[str, dict] = {}
    for task in tqdm(heldout_tasks(n, seed=1, exclude=exclude) if tasks is None else tasks, desc="structured tasks"):
        schema, task_db = trading_schema, db
        if task.tables is not None:  # the client's own tables, with a few rows for each symbol the answer names
            schema, task_db = DatabaseSchema.from_mapping(task.tables), query_db(task.tables, task.expected["sql"])
        stats = out.setdefault(task.kind, {"n": 0, "valid": 0, "correct": 0, "field_hits": 0, "fields": 0,
                                           "examples": []})
        stats["n"] += 1
        text = tok.apply_chat_template(task.messages, tools=task.tools)
        fenced = task.kind == "sql" and wants_fenced_sql(task.messages)
        # a chat that asks for a ```sql block gets the fence opened and the gateway's segment constraint (body +
        # closing fence), as a free-text reply does when the segment detector sees the fence; else response_format
        prompt = tok.encode(text + (SQL_FENCE_OPEN if fenced else ""))
        if task.kind == "tool_call":
            spec = tool_call_spec(task.tools, info, tool_choice="required", parallel_tool_calls=False)
        elif task.kind == "json":
            spec = sb.json_schema_spec(task.schema)
        elif fenced:
            spec = segment_spec("sql", db_schema=schema)
        else:
            spec = sql_spec(schema)
        max_tokens = 256
        constraint = sb.build_constraint(spec, info, eos_ids=eos, max_tokens=max_tokens)
        from engine.sampling_params import SamplingParams

        engine = llm.engine
        engine.add_request("t", prompt, SamplingParams(max_tokens=max_tokens, logits_processors=[constraint]),
                           mode="execution")
        result = None
        while engine.has_work():
            for o in engine.step():
                result = o
        text = segment_body(result.text) if fenced else result.text
        got: object = None  # the parsed output, scored per field below even when validation fails
        try:
            if task.kind == "tool_call":
                calls = validate_tool_calls(text, task.tools, tool_choice="required", parallel_tool_calls=False)
                stats["valid"] += 1
                call = calls[0]
                got = call["arguments"] if isinstance(call["arguments"], dict) else json.loads(call["arguments"])
                stats["correct"] += int(call["name"] == task.expected["name"] and got == _arguments(task))
            elif task.kind == "json":
                got = validate_json(text, task.schema)
                stats["valid"] += 1
                stats["correct"] += int(got == task.expected)
            else:
                got = text
                validate_sql(text, schema)
                stats["valid"] += 1
                rows = [list(r) for r in task_db.execute(text).fetchall()]
                stats["correct"] += int(rows == task.expected["rows"])
        except Exception as exc:  # noqa: BLE001 - an invalid output is a finding, recorded below
            stats.setdefault("errors", []).append({"error": f"{type(exc).__name__}: {exc}"[:200], "output": text[:400]})
        if task.kind == "sql":
            hits, total = sql_literal_matches(got, task.expected["sql"])
        else:
            want = _arguments(task) if task.kind == "tool_call" else task.expected
            hits, total = field_matches(got, want)
            missed = stats.setdefault("missed_fields", {})
            for path in missed_fields(got, want):
                missed[path] = missed.get(path, 0) + 1
        stats["field_hits"] += hits
        stats["fields"] += total
        if len(stats["examples"]) < 2:
            stats["examples"].append({"output": text[:300], "expected": task.expected})
    return out


def _arguments(task) -> dict:
    want = task.expected["arguments"]
    return want if isinstance(want, dict) else json.loads(want)


def _prompts(llm, n: int) -> list[list[int]]:
    from evals.demo.corpus import conversations

    tok = llm.tokenizer
    prompts = []
    for conv in conversations("heldout", n, seed=2):
        msgs = conv.messages[: max(1, conv.answer_index)]
        prompts.append(tok.encode(tok.apply_chat_template(msgs, tools=conv.tools))[-400:])
    return prompts


def quantization_error(model: str, formats: list[str], n: int, steps: int = 16) -> dict:
    """Next-token distributions with each expert format vs bf16 experts, teacher-forced along the bf16
    model's greedy continuation of held-out prompts (every step compared on the same prefix)."""
    from engine.sampling_params import SamplingParams
    from evals.perf.modes_bench import TeacherForcing

    rows, reference = {}, None
    for fmt in ["bf16", *formats]:
        llm = _llm(model, fmt)
        prompts = _prompts(llm, n)
        if reference is None:
            reference = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=steps, ignore_eos=True))]
        procs = [TeacherForcing(ref) for ref in reference]
        llm.generate(prompts, [SamplingParams(max_tokens=len(r), ignore_eos=True, logits_processors=[p])
                               for r, p in zip(reference, procs, strict=True)])
        rows[fmt] = torch.cat([torch.stack(p.rows) for p in procs])
    base = rows["bf16"]
    valid = torch.isfinite(base[0])
    out = {}
    for fmt in formats:
        kl = torch.nn.functional.kl_div(rows[fmt][:, valid].log_softmax(-1), base[:, valid].log_softmax(-1),
                                        log_target=True, reduction="none").sum(-1)
        out[fmt] = {"positions": int(base.shape[0]), "kl_mean": kl.mean().item(), "kl_max": kl.max().item(),
                    "top1_agreement": (rows[fmt].argmax(-1) == base.argmax(-1)).float().mean().item()}
    return out


def routing_skew(model: str, n: int, out_dir: Path) -> dict:
    """Routing counts on a calibration split, then hot-set coverage on a separate split."""
    from engine.sampling_params import SamplingParams

    llm = _llm(model)
    prompts = _prompts(llm, 2 * n)
    calib, test = prompts[:n], prompts[n:]

    def counts(batch):
        for le in llm.engine.layer_experts.values():
            le.counts.zero_()
        llm.generate(batch, SamplingParams(max_tokens=8))
        return torch.stack([llm.engine.layer_experts[i].counts.clone() for i in sorted(llm.engine.layer_experts)])

    c_calib, c_test = counts(calib).float(), counts(test).float()  # [L, E]
    e = c_calib.shape[1]
    hot = max(1, e // 4)
    share = c_test / c_test.sum(-1, keepdim=True)
    uniform = share[:, :hot].sum(-1)
    freq_ids = c_calib.argsort(-1, descending=True)[:, :hot]
    frequency = share.gather(1, freq_ids).sum(-1)
    _plot_skew(out_dir / "routing_skew.png", share)
    return {"experts": e, "hot_per_layer": hot,
            "top_expert_share_per_layer": share.max(-1).values.tolist(),
            "hot_coverage_uniform": uniform.tolist(), "hot_coverage_frequency": frequency.tolist(),
            "mean_coverage_uniform": uniform.mean().item(), "mean_coverage_frequency": frequency.mean().item()}


def _plot_skew(path: Path, share: torch.Tensor) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.6 * share.shape[0] + 1.5))
    im = ax.imshow(share.numpy(), aspect="auto", cmap="magma")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_title("share of routed token slots per expert (held-out prompts)")
    fig.colorbar(im)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def determinism(model: str, repeats: int) -> dict:
    """Execution-mode logits bytes across repeats, alone and amid exploration traffic."""
    from engine.sampling_params import LogitsRecorder, SamplingParams

    llm = _llm(model, "int4", defer=0)
    engine = llm.engine
    prompts = _prompts(llm, 6)
    digests = set()
    for rep in range(repeats):
        rec = LogitsRecorder()
        for i, p in enumerate(prompts[1 : 1 + rep % 6]):
            engine.add_request(f"e{rep}-{i}", p, SamplingParams(max_tokens=8, temperature=0.9, seed=rep))
        engine.add_request("x", prompts[0], SamplingParams(max_tokens=16, logits_processors=[rec]), mode="execution")
        while engine.has_work():
            engine.step()
        digests.add(hash(rec.bytes()))
    return {"repeats": repeats, "distinct_outputs": len(digests)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="moegate eval", description=__doc__.splitlines()[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=str(DEMO))
    ap.add_argument("--out", default="evals/out")
    ap.add_argument("--tasks", type=int, default=30, help="held-out structured tasks")
    ap.add_argument("--quick", action="store_true", help="small sample sizes (minutes)")


def run(args: argparse.Namespace) -> int:
    from evals.perf import modes_bench

    out = Path(args.out)
    report_dir = out / "report"
    report_dir.mkdir(parents=True, exist_ok=True)
    n = 6 if args.quick else 24
    t0 = time.time()
    results = {"model": args.model}
    steps = [
        ("structured", lambda: structured_tasks(args.model, 9 if args.quick else args.tasks)),
        ("determinism", lambda: determinism(args.model, 5 if args.quick else 20)),
        ("quantization", lambda: quantization_error(args.model, ["int8", "int4"], n)),
        ("routing", lambda: routing_skew(args.model, n, report_dir)),
        ("modes", lambda: modes_bench.main(["--model", args.model, "--out", str(report_dir)]
                                           + (["--quick"] if args.quick else []))),
        ("constraints", lambda: constraint_suite(report_dir / "constraints", args.quick)),
    ]
    for name, fn in tqdm(steps, desc="moegate eval"):
        results[name] = fn()
    for name in ("kernels/kernel_bench.json", "engine/engine_bench.json"):
        path = out / name
        if path.is_file():
            results[name] = json.loads(path.read_text())
    results["seconds"] = time.time() - t0
    (report_dir / "report.json").write_text(json.dumps(results, indent=2, default=str))
    (report_dir / "report.md").write_text(render_markdown(results))
    print(f"report written to {report_dir / 'report.md'}")
    return 0


def constraint_suite(out_dir: Path, quick: bool) -> dict:
    """The gateway's constraints on public benchmarks (evals/structured/run.py), on a spread sample.

    JSONSchemaBench (schemas compiled, outputs valid), Spider dev gold queries (accepted by the SQL grammar and
    scope guard, passing the sqlglot policy) and BFCL function-calling entries (tool-call grammar compiled,
    outputs valid), all with the Qwen vocabulary and random logits: every token choice the grammar allows.
    """
    from evals.structured import run as suite

    if not (suite.DATA / "jsonschemabench").is_dir():
        return {"skipped": f"no benchmark data under {suite.DATA}"}
    limits = ["--schemas-per-split", "10", "--gen-per-split", "5", "--sql-limit", "20", "--sql-walks", "2",
              "--bfcl-limit", "5", "--decode-model", "none"] if quick \
        else ["--schemas-per-split", "150", "--gen-per-split", "40", "--sql-limit", "300", "--sql-walks", "30",
              "--bfcl-limit", "60"]
    suite.main(["--out", str(out_dir), "--parts", "json,sql,bfcl", "--timed-generations", "5", *limits])
    return json.loads((out_dir / "results.json").read_text())


def _constraint_section(c: dict) -> list[str]:
    lines = ["## Constraints on public benchmarks (evals/structured, sampled)\n"]
    if "skipped" in c:
        return lines + [f"Skipped: {c['skipped']}.\n"]
    lines.append("Qwen vocabulary, random logits under the constraint (any token the grammar allows); the full "
                 "runs are in `evals/structured/results/`.\n\n![constraints](constraints/results.png)\n")
    lines.append("| JSONSchemaBench split | schemas | compiled | llguidance alone | compile p50 / p99 ms | "
                 "valid of generated (after the retry) | typed errors |\n|---|---|---|---|---|---|---|")
    for split, x in c["json_schema"].items():
        lines.append(f"| {split} | {x['schemas']} | {x['compiled_pct']:.1f}% | {x.get('llguidance_alone_pct', float('nan')):.1f}% | "
                     f"{x['compile_ms_p50']:.1f} / {x['compile_ms_p99']:.1f} | {x['valid']}/{x['generated']} | "
                     f"{x.get('typed_errors', 0)} |")
    q = c["sql"]
    lines.append(f"\nSpider dev gold SQL ({q['queries']} queries; Postgres: transpiled by sqlglot), accepted by:\n")
    lines.append("| dialect | grammar | grammar + guard | validator | all three | adversarial accepted | "
                 "random walks valid / finished |\n|---|---|---|---|---|---|---|")
    for d, x in q["dialects"].items():
        w = x["random_walks"] or {"valid": "-", "finished": "-"}
        lines.append(f"| {d} | {x['grammar_pct']:.1f}% | {x['grammar_guard_pct']:.1f}% | {x['validator_pct']:.1f}% | "
                     f"{x['all_three_pct']:.1f}% | {x['adversarial_accepted']}/{x['adversarial_total']} | "
                     f"{w['valid']}/{w['finished']} |")
    lines.append("| BFCL set | entries | tool_choice | compiled | valid | with calls |\n|---|---|---|---|---|---|")
    for name, b in c["bfcl"].items():
        lines.append(f"| {name} | {b['entries']} | {b['tool_choice']} | {b['compiled']} | {b['valid']} | "
                     f"{b['outputs_with_calls']} |")
    return lines


def render_markdown(r: dict) -> str:
    lines = [f"# moegate eval report\n\nModel: `{r['model']}`\n"]
    lines.append("## Structured outputs (held-out tasks, constrained, execution mode)\n")
    lines.append("| kind | tasks | valid | semantically right | fields right |\n|---|---|---|---|---|")
    for kind, s in r["structured"].items():
        lines.append(f"| {kind} | {s['n']} | {s['valid'] / s['n']:.0%} | {s['correct'] / s['n']:.0%} | "
                     f"{s['field_hits'] / max(1, s['fields']):.0%} |")
    lines.append("\n*Fields right*: expected tool-call argument / JSON leaf fields reproduced exactly, or for SQL "
                 "the reference query's literals found in the output.\n")
    d = r["determinism"]
    lines.append(f"\n## Determinism\n\nExecution-mode logits over {d['repeats']} runs amid varying exploration "
                 f"traffic: {d['distinct_outputs']} distinct byte string(s) (1 = bit-identical).\n")
    lines.append("## Quantization error vs bf16 experts (next-token, held-out prompts)\n")
    lines.append("| format | mean KL (nats) | max KL | top-1 agreement |\n|---|---|---|---|")
    for fmt, q in r["quantization"].items():
        lines.append(f"| {fmt} | {q['kl_mean']:.4f} | {q['kl_max']:.4f} | {q['top1_agreement']:.0%} |")
    g = r["routing"]
    lines.append(f"\n## Routing skew and placement\n\n![routing skew](routing_skew.png)\n\nWith {g['hot_per_layer']} "
                 f"of {g['experts']} experts per layer hot, the share of routed slots a hot set serves on unseen "
                 f"prompts: `uniform` (experts 0..{g['hot_per_layer'] - 1}) {g['mean_coverage_uniform']:.0%}, "
                 f"`frequency` (most-routed on a calibration split) {g['mean_coverage_frequency']:.0%}.\n")
    m = r["modes"]
    lines.append("## Exploration vs execution\n\n![deferral](modes_bench.png) ![timeline](modes_timeline.png)\n")
    lines.append("| deferred experts d | decode tok/s | vs strict | mean KL | top-1 |\n|---|---|---|---|---|")
    for dd, x in m["depths"].items():
        lines.append(f"| {dd} | {x['decode_tok_s']:.1f} | {x['speedup_vs_strict']:.2f}x | {x['kl_mean']:.4f} | "
                     f"{x['top1_agreement']:.0%} |")
    lines.append(f"\nExecution mode decodes at {m['execution_decode_tok_s']:.1f} tok/s "
                 f"({m['execution_cost']:.2f}x the time per token of strict exploration).\n")
    lines += _constraint_section(r["constraints"])
    for name in ("kernels/kernel_bench.json", "engine/engine_bench.json"):
        if name in r:
            lines.append(f"## {name}\n\n```json\n{json.dumps(r[name].get('ratios', r[name]), indent=1)[:3000]}\n```\n")
    lines.append(f"\nMachine load during the run is recorded in report.json. Took {r['seconds']:.0f} s.\n")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
