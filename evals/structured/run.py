"""Structured-decoding eval: JSONSchemaBench coverage/speed/validity, Spider grammar coverage,
BFCL tool calls. Writes results.json + results.png.

    PYTHONPATH=. python -m evals.structured.run [--gen-per-split N] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from evals.perf.common import machine_info
from gateway.structured.base import ConstraintSpec
from gateway.structured.bitmask import apply_bitmask_, bitmask_words, row_allows, row_ids
from gateway.structured.build import json_schema_spec
from gateway.structured.closing import completion_hints, shortest_completion
from gateway.structured.constraint import Constraint
from gateway.structured.errors import ConstraintCompileTimeout, StructuredOutputError, UnsupportedSchemaError
from gateway.structured.registry import get_backend
from gateway.structured.sql_grammar import sql_spec
from gateway.structured.sql_schema import DatabaseSchema, SQLPolicy
from gateway.structured.sql_validate import check_sql
from gateway.structured.tools import tool_call_spec
from gateway.structured.validate import validate_json, validate_tool_calls
from gateway.structured.vocab import TokenizerInfo

from .driver import LogitsFn, random_logits
from .engine_overhead import DEMO_MODEL
from .qwen_vocab import QWEN_EOS_IDS, QWEN_MODEL_VOCAB, qwen_tokenizer_json
from .sql_walks import random_walks

DATA = Path("/work/shared/evaldata")
# Every JSONSchemaBench split found in DATA/jsonschemabench (one schema per line), in name order.
SPLITS = tuple(sorted(p.stem for p in (DATA / "jsonschemabench").glob("*.jsonl")))


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def compile_timed(spec: ConstraintSpec, tok: TokenizerInfo, backend: str, timeout_s: float):
    """Compile with the same bound as the gateway's cache (thread + timeout)."""
    import concurrent.futures as cf

    impl = get_backend(spec.kind, backend)
    with cf.ThreadPoolExecutor(1) as pool:
        t0 = time.perf_counter()
        fut = pool.submit(impl.compile, spec, tok)
        try:
            compiled = fut.result(timeout=timeout_s)
        except cf.TimeoutError:
            raise ConstraintCompileTimeout(spec.kind, timeout_s) from None
        return compiled, time.perf_counter() - t0


def generate(compiled, logits_fn: LogitsFn | None, vocab: int, max_tokens: int, stats: dict,
             seed: int = 0) -> tuple[list[int], bool]:
    """Decode under the constraint, timing mask fill and mask apply separately. With `logits_fn`
    None the step is a random model drawn cheaply: a uniform choice among the allowed ids, which is
    what argmax over i.i.d. Gaussian logits picks (no 152k-float draw or apply per step)."""
    c = Constraint(compiled, max_tokens=max_tokens, closing_window=max(32, max_tokens // 4))
    bitmask = torch.empty(1, bitmask_words(vocab), dtype=torch.int32)
    rng = np.random.default_rng(seed)
    ids: list[int] = []
    for _ in range(max_tokens):
        t0 = time.perf_counter()
        c.advance(ids)
        c.fill_bitmask(bitmask, 0)
        t1 = time.perf_counter()
        stats["fill_us"].append((t1 - t0) * 1e6)
        if logits_fn is None:
            allowed = row_ids(bitmask[0], vocab)
            token = int(allowed[rng.integers(len(allowed))])
        else:
            logits = logits_fn(ids).view(1, -1)
            t1 = time.perf_counter()
            apply_bitmask_(logits, bitmask)
            stats["apply_us"].append((time.perf_counter() - t1) * 1e6)
            token = int(torch.argmax(logits))
        ids.append(token)
        if token in c.eos_ids:
            c.advance(ids)
            return ids, c.is_accepting()
    return ids, False


def completion_length(compiled, tok: TokenizerInfo, max_tokens: int) -> int | None:
    """Tokens of the shortest valid output the closing planner finds from the start (None: none fits
    in `max_tokens` with its end-of-sequence token)."""
    path = shortest_completion(compiled.new_matcher().llg, tok, max_tokens - 1, completion_hints(compiled.spec.source))
    return None if path is None else len(path)


def _sample(rows: list, n: int) -> list:
    """`n` rows evenly spread over `rows` (0: all of them)."""
    if not n or n >= len(rows):
        return rows
    return [rows[i * len(rows) // n] for i in range(n)]


def llguidance_alone(schema, tok: TokenizerInfo) -> bool:
    """The peer baseline: llguidance's own JSON Schema compile with its default options."""
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    except ValueError:
        return False
    return not llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tok.llg)[0]


def eval_json(tok: TokenizerInfo, args) -> dict:
    out = {}
    for split in SPLITS:
        rows = [json.loads(line) for line in open(DATA / "jsonschemabench" / f"{split}.jsonl")]
        rows = _sample(rows, args.schemas_per_split)
        errors: Counter = Counter()
        methods: Counter = Counter()  # keyword=method over the compiled schemas (not all-grammar ones)
        compiled, times, alone = [], [], 0
        for row in tqdm(rows, desc=f"compile {split}"):
            schema = json.loads(row["schema"]) if isinstance(row["schema"], str) else row["schema"]
            alone += llguidance_alone(schema, tok)
            try:
                c, dt = compile_timed(json_schema_spec(row["schema"]), tok, "llguidance", args.compile_timeout)
                compiled.append((row, c))
                times.append(dt)
                methods.update(f"{k}={m}" for k, m in c.enforcement.keywords.items() if m != "grammar")
            except UnsupportedSchemaError as e:
                errors[f"unsupported:{e.keyword}"] += 1
            except StructuredOutputError as e:
                errors[f"{type(e).__name__}: {str(e)[:120]}"] += 1
        stats = {"fill_us": [], "apply_us": []}
        valid = finished = first_valid = typed_errors = 0
        gen = _sample(compiled, args.gen_per_split)
        bad = []
        over_budget = []  # schemas whose shortest valid output does not fit in max_tokens
        for i, (row, c) in enumerate(tqdm(gen, desc=f"generate {split}")):
            logits_fn = random_logits(QWEN_MODEL_VOCAB, i) if i < args.timed_generations else None
            ids, done = generate(c, logits_fn, QWEN_MODEL_VOCAB, args.max_tokens, stats, seed=i)
            finished += done
            if not done and (need := completion_length(c, tok, args.max_tokens)) is None:
                # no valid output fits: decode again with room for one (the gateway ends such a
                # request with finish_reason "length" and a typed error, never with invalid JSON)
                need = completion_length(c, tok, args.retry_max_tokens)
                ids, done = generate(c, None, QWEN_MODEL_VOCAB, args.retry_max_tokens, {"fill_us": [], "apply_us": []},
                                     seed=i)
                over_budget.append({"id": row.get("id"), "shortest_tokens": need, "retry_max_tokens":
                                    args.retry_max_tokens, "finished_on_retry": done})
            # the gateway's path: validate; on failure one strict retry (here: another seed), then a
            # typed error; an invalid output never leaves
            for attempt in range(1 + args.strict_retries):
                if attempt:
                    ids, done = generate(c, None, QWEN_MODEL_VOCAB, args.max_tokens, {"fill_us": [], "apply_us": []},
                                         seed=1_000_003 * attempt + i)
                try:
                    validate_json(tok.decode(ids[:-1] if done else ids), row["schema"])
                    valid += 1
                    first_valid += attempt == 0
                    break
                except StructuredOutputError as e:
                    error = str(e)[:200]
            else:
                typed_errors += 1
                bad.append({"id": row.get("id"), "finished": done, "error": error})
        out[split] = {
            "schemas": len(rows), "compiled": len(compiled), "compiled_pct": 100 * len(compiled) / len(rows),
            "llguidance_alone": alone, "llguidance_alone_pct": 100 * alone / len(rows),
            "compile_ms_p50": 1e3 * pct(times, 0.5), "compile_ms_p99": 1e3 * pct(times, 0.99),
            "errors": dict(errors.most_common()), "enforcement": dict(methods.most_common()),
            "generated": len(gen), "finished": finished, "valid": valid, "valid_first_attempt": first_valid,
            "typed_errors": typed_errors,
            "valid_pct_of_generated": 100 * valid / max(1, len(gen)),
            "valid_pct_of_compiled": 100 * valid / max(1, len(compiled)) if len(gen) == len(compiled) else None,
            "mask_fill_us_per_token_mean": statistics.fmean(stats["fill_us"]) if stats["fill_us"] else None,
            "mask_fill_us_per_token_p50": pct(stats["fill_us"], 0.5),
            "mask_fill_us_per_token_p99": pct(stats["fill_us"], 0.99),
            "mask_apply_us_per_token_p50": pct(stats["apply_us"], 0.5),
            "tokens": len(stats["fill_us"]), "invalid_examples": bad[:5],
            "over_budget": over_budget,
        }
        print(split, {k: v for k, v in out[split].items() if k != "invalid_examples"})
    return out


def eval_outlines(tok: TokenizerInfo, args) -> dict:
    """outlines-core on the same schemas: coverage after the keyword audit (cheap: regex only) and
    compile / mask cost on a small sample (its token index over 151k ids takes seconds)."""
    from gateway.structured.json_schema import outlines_json_regex

    out = {}
    for split in SPLITS:
        rows = [json.loads(line) for line in open(DATA / "jsonschemabench" / f"{split}.jsonl")]
        rows = _sample(rows, args.schemas_per_split)
        ok, errors = [], Counter()
        for row in rows:
            try:
                outlines_json_regex(row["schema"])
                ok.append(row)
            except UnsupportedSchemaError as e:
                errors[f"unsupported:{e.keyword}"] += 1
            except StructuredOutputError as e:
                errors[type(e).__name__] += 1
        times, fill, compiled_n = [], [], 0
        for row in tqdm(ok[: args.outlines_sample], desc=f"outlines {split}"):
            try:
                c, dt = compile_timed(json_schema_spec(row["schema"]), tok, "outlines-core", args.outlines_timeout)
            except StructuredOutputError as e:
                errors[f"sample:{type(e).__name__}"] += 1
                continue
            compiled_n += 1
            times.append(dt)
            stats = {"fill_us": [], "apply_us": []}
            generate(c, random_logits(QWEN_MODEL_VOCAB, 0), QWEN_MODEL_VOCAB, 64, stats)
            fill += stats["fill_us"]
        out[split] = {"audit_pass_pct": 100 * len(ok) / len(rows), "errors": dict(errors.most_common(8)),
                      "sample": min(len(ok), args.outlines_sample), "sample_compiled": compiled_n,
                      "compile_s_p50": pct(times, 0.5), "compile_s_max": max(times) if times else None,
                      "mask_fill_us_p50": pct(fill, 0.5)}
        print("outlines", split, out[split])
    return out


def eval_regex(tok: TokenizerInfo, args) -> dict:
    """Regex kind, both backends, on `pattern` values taken from the JSONSchemaBench schemas."""
    import re

    from gateway.structured.build import regex_spec
    from gateway.structured.json_schema import walk

    patterns: list[str] = []
    for split in SPLITS:
        for line in open(DATA / "jsonschemabench" / f"{split}.jsonl"):
            for _, sub in walk(json.loads(line)["schema"]):
                p = sub.get("pattern")
                if isinstance(p, str) and p.startswith("^") and p.endswith("$") and p not in patterns:
                    patterns.append(p)
    patterns = patterns[: args.regex_patterns]
    out = {"patterns": len(patterns)}
    for backend in ("llguidance", "outlines-core"):
        times, fill, errors, valid, finished = [], [], Counter(), 0, 0
        for i, pattern in enumerate(tqdm(patterns, desc=f"regex {backend}")):
            body = pattern[1:-1]  # whole-output match; anchors are implicit
            try:
                c, dt = compile_timed(regex_spec(body), tok, backend, args.outlines_timeout)
            except StructuredOutputError as e:
                errors[type(e).__name__] += 1
                continue
            times.append(dt)
            stats = {"fill_us": [], "apply_us": []}
            ids, done = generate(c, random_logits(QWEN_MODEL_VOCAB, i), QWEN_MODEL_VOCAB, 96, stats)
            fill += stats["fill_us"]
            finished += done
            text = tok.decode(ids[:-1] if done else ids)
            try:
                valid += done and re.fullmatch(body, text) is not None
            except re.error:
                errors["python_re_cannot_check"] += 1
        out[backend] = {"compiled": len(times), "errors": dict(errors), "compile_ms_p50": 1e3 * pct(times, 0.5),
                        "compile_ms_max": 1e3 * max(times) if times else None, "mask_fill_us_p50": pct(fill, 0.5),
                        "finished": finished, "valid_fullmatch": valid}
        print("regex", backend, out[backend])
    return out


def scope_vetoes(compiled, ids: list[int], stats: dict | None = None) -> str | None:
    """Feed a gold query through the full SQL Constraint (grammar mask, then the alias-scope guard's
    filter): the first gold token the guard rules out (as text), or None when every one is allowed.
    With `stats`, each step's grammar fill and guard filter seconds go to its "fill_s" / "guard_s"."""
    c = Constraint(compiled)
    bitmask = torch.empty(1, bitmask_words(c.vocab_size), dtype=torch.int32)
    guard = c.guard
    for t in ids:
        fallbacks = c.guard_fallbacks
        c.guard = None if stats is not None else guard  # (timed: the grammar, then the guard on its row)
        t0 = time.perf_counter()
        c.fill_bitmask(bitmask, 0)
        if stats is not None:
            t1 = time.perf_counter()
            c.guard = guard
            row = bitmask[0].numpy().view(np.uint32)
            guard.filter(row)
            stats["fill_s"].append(t1 - t0)
            stats["guard_s"].append(time.perf_counter() - t1)
            if not row.any():
                c.guard_fallbacks += 1
        if c.guard_fallbacks > fallbacks or not row_allows(bitmask[0], np.array([t]))[0]:
            return compiled.tokenizer.decode([t])
        c.consume(t)
    return None


SQL_DIALECTS = ("sqlite", "postgres")
WALK_SCHEMA = {"prices": ["ticker", "ts", "price"], "trades": ["id", "ticker", "qty", "Market Value"]}


def _sql_three(compiled, tok: TokenizerInfo, sql: str, schema: DatabaseSchema, dialect: str,
               stats: dict | None = None) -> dict:
    """Grammar alone, grammar + scope guard (what decoding admits), validator: each accepts `sql`?"""
    ids = tok.encode(sql)
    m = compiled.new_matcher()
    grammar = all(m.consume(t) for t in ids) and m.is_accepting()
    guard = grammar and scope_vetoes(compiled, ids, stats) is None
    try:
        check_sql(sql, schema, SQLPolicy(dialect=dialect, max_limit=None))
        validator, rule = True, None
    except StructuredOutputError as e:
        validator, rule = False, getattr(e, "rule", type(e).__name__)
    return {"grammar": grammar, "guard": guard, "validator": validator, "all": guard and validator, "rule": rule}


def _gold(dialect: str, sql: str, schema: DatabaseSchema) -> str | None:
    """A gold query (SQLite) in `dialect` (sqlglot's transpiler, after SQLite's reading of "..." that
    names no column as a string; None where it cannot)."""
    if dialect == "sqlite":
        return sql
    import sqlglot

    from gateway.structured.sql_validate import _sqlite_double_quoted_strings

    try:
        tree = sqlglot.parse_one(sql, read="sqlite")
        _sqlite_double_quoted_strings(tree, schema, [])
        return tree.sql(dialect=dialect)
    except sqlglot.errors.SqlglotError:
        return None


def decode_step_ms(model: Path, requests: int = 6, max_tokens: int = 48) -> dict:
    """Unconstrained decode steps of `model` in the engine (execution mode, the one SQL runs in), on
    this machine in this run: p50 and mean milliseconds."""
    from engine.llm_engine import LLM
    from engine.sampling_params import SamplingParams

    from .engine_overhead import _decode_steps

    llm = LLM(str(model), prefix_cache=False, progress=False)
    prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Which ticker had the highest price yesterday? Reply with one SQL query."}]))
    _decode_steps(llm.engine, "warm", prompt, SamplingParams(max_tokens=4), "execution")
    steps: list[float] = []
    for i in range(requests):
        steps += _decode_steps(llm.engine, f"step-{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                               "execution")
    llm.engine.runner.shutdown()
    return {"model": str(model), "steps": len(steps), "step_ms_p50": 1e3 * statistics.median(steps),
            "step_ms_mean": 1e3 * statistics.fmean(steps)}


def eval_sql(tok: TokenizerInfo, args) -> dict:
    """Gold queries (Spider dev) through grammar, guard, validator, per dialect; the adversarial set;
    random walks (every finished one must validate); compile and mask cost."""
    import sqlglot  # noqa: F401

    tables = {t["db_id"]: t for t in json.load(open(DATA / "sql" / "spider_tables.json"))}
    dev = _sample(json.load(open(DATA / "sql" / "spider_dev.json")), args.sql_limit)
    adversarial = json.loads((Path(__file__).parent / "data" / "sql_adversarial.json").read_text())
    out: dict = {"queries": len(dev), "dialects": {}, "machine": machine_info()}
    if args.decode_model is not None:  # the decode step the guard's cost is compared with, in this run
        out["decode_step"] = decode_step_ms(args.decode_model)
        print("decode step", out["decode_step"])
    for dialect in args.sql_dialects.split(","):
        compiled, compile_s = {}, []
        counts: Counter = Counter()
        rules: Counter = Counter()
        rejected: dict[str, list] = {"grammar": [], "guard": [], "validator": []}
        untranspiled = 0
        steps: dict[str, list[float]] = {"fill_s": [], "guard_s": []}
        for q in tqdm(dev, desc=f"spider {dialect}"):
            db = q["db_id"]
            schema = DatabaseSchema.from_spider(tables[db])
            if db not in compiled:
                compiled[db], dt = compile_timed(sql_spec(schema, SQLPolicy(dialect=dialect)), tok, "llguidance",
                                                 args.compile_timeout)
                compile_s.append(dt)
            sql = _gold(dialect, q["query"], schema)
            if sql is None:
                untranspiled += 1
                continue
            r = _sql_three(compiled[db], tok, sql, schema, dialect, steps)
            counts.update(k for k in ("grammar", "guard", "validator", "all") if r[k])
            if r["rule"]:
                rules[r["rule"]] += 1
            for k in ("grammar", "guard", "validator"):
                if not r[k] and (k == "grammar" or r["grammar"] or k == "validator"):
                    rejected[k].append(sql)
        schema = DatabaseSchema.from_mapping(adversarial["schema"])
        adv = compile_timed(sql_spec(schema, SQLPolicy(dialect=dialect)), tok, "llguidance", args.compile_timeout)[0]
        adv_accepted = [s for s in adversarial["must_reject"] if _sql_three(adv, tok, s, schema, dialect)["all"]]
        adv_refused = [s for s in adversarial["must_accept"] if not _sql_three(adv, tok, s, schema, dialect)["all"]]
        n = len(dev)
        walks = random_walks(tok, DatabaseSchema.from_mapping(WALK_SCHEMA), dialect, args.sql_walks).summary() \
            if args.sql_walks else None
        out["dialects"][dialect] = {
            "grammar_pct": 100 * counts["grammar"] / n, "grammar_guard_pct": 100 * counts["guard"] / n,
            "validator_pct": 100 * counts["validator"] / n, "all_three_pct": 100 * counts["all"] / n,
            "untranspiled": untranspiled, "validator_fail_rules": dict(rules),
            "databases": len(compiled), "compile_ms_p50": 1e3 * pct(compile_s, 0.5),
            "compile_ms_p99": 1e3 * pct(compile_s, 0.99), "compile_ms_max": 1e3 * max(compile_s),
            "adversarial_accepted": len(adv_accepted), "adversarial_total": len(adversarial["must_reject"]),
            "adversarial_accepted_examples": adv_accepted, "must_accept_refused": adv_refused,
            "random_walks": walks, "gold_steps": len(steps["guard_s"]),
            **{f"{k[:-2]}_ms_{q}": 1e3 * v for k, xs in steps.items()
               for q, v in (("p50", pct(xs, 0.5)), ("mean", float(np.mean(xs)) if xs else float("nan")),
                            ("p99", pct(xs, 0.99)))},
            "rejected_examples": {k: v[:8] for k, v in rejected.items()},
        }
        print("sql", dialect, {k: v for k, v in out["dialects"][dialect].items()
                               if k not in ("rejected_examples", "random_walks")})
        if walks:
            print("sql walks", dialect, {k: v for k, v in walks.items() if k != "examples"})
        if "decode_step" in out:
            step = out["decode_step"]["step_ms_p50"]
            row = out["dialects"][dialect]
            row["mask_pct_of_step"] = {q: 100 * (row[f"fill_ms_{q}"] + row[f"guard_ms_{q}"]) / step
                                       for q in ("p50", "mean", "p99")}
            row["guard_pct_of_step"] = {q: 100 * row[f"guard_ms_{q}"] / step for q in ("p50", "mean", "p99")}
    return out


def bfcl_to_json_schema(s):
    """BFCL's parameter dialect (dict/float/tuple/any) to JSON Schema; eval-local conversion."""
    if isinstance(s, list):
        return [bfcl_to_json_schema(x) for x in s]
    if not isinstance(s, dict):
        return s
    out = {}
    for k, v in s.items():
        if k == "type" and isinstance(v, str):
            if v == "any":
                continue
            out[k] = {"dict": "object", "float": "number", "tuple": "array"}.get(v, v)
        elif k in ("properties",) and isinstance(v, dict):
            out[k] = {name: bfcl_to_json_schema(sub) for name, sub in v.items()}
        else:
            out[k] = bfcl_to_json_schema(v)
    return out


def eval_bfcl(tok: TokenizerInfo, args) -> dict:
    out = dict(json.loads((args.out / "results.json").read_text()).get("bfcl", {})) if (
        args.out / "results.json").exists() else {}
    for name in args.bfcl_sets.split(","):
        # irrelevance: no tool fits the question, so the call is optional (tool_choice auto)
        choice = "auto" if name == "irrelevance" else "required"
        rows = [json.loads(line) for line in open(DATA / "bfcl" / f"BFCL_v4_{name}.jsonl")]
        rows = _sample(rows, args.bfcl_limit)
        compiled_n = valid = with_calls = 0
        errors: Counter = Counter()
        stats = {"fill_us": [], "apply_us": []}
        for i, row in enumerate(tqdm(rows, desc=f"bfcl {name}")):
            tools = [{"type": "function", "function": {**fn, "parameters": bfcl_to_json_schema(fn["parameters"])}}
                     for fn in row["function"]]
            try:
                spec = tool_call_spec(tools, tok, choice, parallel_tool_calls=True)
                c, _ = compile_timed(spec, tok, "llguidance", args.compile_timeout)
            except UnsupportedSchemaError as e:
                errors[f"unsupported:{e.keyword}"] += 1
                continue
            except StructuredOutputError as e:
                errors[type(e).__name__] += 1
                continue
            compiled_n += 1
            ids, done = generate(c, random_logits(QWEN_MODEL_VOCAB, i), QWEN_MODEL_VOCAB, args.max_tokens, stats)
            try:
                calls = validate_tool_calls(tok.decode(ids[:-1] if done else ids), tools, choice)
                valid += 1
                with_calls += bool(calls)
            except StructuredOutputError as e:
                errors[f"invalid:{type(e).__name__}"] += 1
        out[name] = {"entries": len(rows), "tool_choice": choice, "compiled": compiled_n, "valid": valid,
                     "outputs_with_calls": with_calls,
                     "valid_pct_of_compiled": 100 * valid / max(1, compiled_n), "errors": dict(errors),
                     "mask_fill_us_p50": pct(stats["fill_us"], 0.5)}
        print("bfcl", name, out[name])
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    js = results["json_schema"]
    x, w = np.arange(len(SPLITS)), 0.38
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.2))
    ax = axes[0]
    w3 = w * 2 / 3
    ax.bar(x - w3, [js[s]["compiled_pct"] for s in SPLITS], w3, label="moegate compiled %")
    ax.bar(x, [js[s].get("llguidance_alone_pct", float("nan")) for s in SPLITS], w3, label="llguidance alone %")
    ax.bar(x + w3, [js[s]["valid_pct_of_generated"] for s in SPLITS], w3, label="valid % of generated")
    ax.axhline(95, color="r", ls="--", lw=1)
    ax.set(title="JSONSchemaBench", xticks=x, xticklabels=SPLITS, ylim=(0, 105))
    ax.legend(loc="lower left")
    ax = axes[1]
    ax.bar(x - w / 2, [js[s]["mask_fill_us_per_token_p50"] for s in SPLITS], w, label="fill p50")
    ax.bar(x + w / 2, [js[s]["mask_apply_us_per_token_p50"] for s in SPLITS], w, label="apply p50")
    ax.set(title="mask µs / token (151,936 logits)", xticks=x, xticklabels=SPLITS)
    ax.legend()
    sql, bf = results["sql"], results["bfcl"]
    names = [f"Spider {d} all three" for d in sql["dialects"]] + [f"BFCL {k}" for k in bf]
    vals = [v["all_three_pct"] for v in sql["dialects"].values()]
    vals += [bf[k]["valid_pct_of_compiled"] for k in bf]
    axes[2].bar(names, vals)
    axes[2].axhline(95, color="r", ls="--", lw=1)
    axes[2].set(title="SQL gold accepted % / tool calls valid %", ylim=(0, 105))
    axes[2].tick_params(axis="x", rotation=15)
    ax = axes[3]
    ol = results.get("outlines_core")
    if ol:
        ax.bar(x - w / 2, [js[s]["compile_ms_p50"] for s in SPLITS], w, label="llguidance")
        ax.bar(x + w / 2, [1e3 * (ol[s]["compile_s_p50"] or float("nan")) for s in SPLITS], w, label="outlines-core")
        ax.set(yscale="log", title="JSON compile ms p50 (log)", xticks=x, xticklabels=SPLITS)
        ax.legend()
    for a in (axes[0], axes[1], axes[3]):
        a.tick_params(axis="x", rotation=15)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def overhead_summary(splits: dict, decode_step_ms: float) -> dict:
    """Mask work per token as a share of one decode step, worst split: p50 and mean (the mean carries
    the closing planner's occasional searches)."""
    step_us = decode_step_ms * 1e3
    worst = {k: max(v[k] for v in splits.values()) for k in
             ("mask_fill_us_per_token_p50", "mask_fill_us_per_token_mean", "mask_apply_us_per_token_p50")}
    return {
        "decode_step_ms": decode_step_ms,
        "serial_pct_p50": 100 * (worst["mask_fill_us_per_token_p50"] + worst["mask_apply_us_per_token_p50"]) / step_us,
        "serial_pct_mean": 100 * (worst["mask_fill_us_per_token_mean"] + worst["mask_apply_us_per_token_p50"]) / step_us,
        "overlapped_pct_p50": 100 * worst["mask_apply_us_per_token_p50"] / step_us,
        "note": "serial: fill + apply in the sampler (CPU default); overlapped: the fill runs during the forward "
                "pass (prefetch, the CUDA default), only apply is exposed. engine_overhead.json measures it end to end.",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, default=Path("evals/structured/results"))
    p.add_argument("--schemas-per-split", type=int, default=0, help="schemas per split, evenly spread (0: all)")
    p.add_argument("--gen-per-split", type=int, default=0, help="generations per split (0: all compiled)")
    p.add_argument("--sql-limit", type=int, default=0, help="Spider dev queries, evenly spread (0: all)")
    p.add_argument("--sql-dialects", default=",".join(SQL_DIALECTS))
    p.add_argument("--sql-walks", type=int, default=60, help="random walks through the SQL constraint per dialect")
    p.add_argument("--decode-model", type=lambda v: None if v == "none" else Path(v),
                   default=DEMO_MODEL if DEMO_MODEL.exists() else None,
                   help="model whose unconstrained decode step the SQL mask cost is compared with in this run "
                        "(none: not measured)")
    p.add_argument("--timed-generations", type=int, default=50,
                   help="per split, the first N draw full Gaussian logits and time the apply; the rest draw "
                        "uniformly among the allowed ids (the same distribution, without the 152k-float draw)")
    p.add_argument("--max-tokens", type=int, default=384)
    p.add_argument("--retry-max-tokens", type=int, default=16384,
                   help="budget for a schema whose shortest valid output exceeds --max-tokens")
    p.add_argument("--compile-timeout", type=float, default=10.0)
    p.add_argument("--strict-retries", type=int, default=1, help="as the gateway: regenerations after a failed validation")
    p.add_argument("--outlines-sample", type=int, default=3)
    p.add_argument("--outlines-timeout", type=float, default=120.0)
    p.add_argument("--bfcl-limit", type=int, default=0)
    p.add_argument("--regex-patterns", type=int, default=20)
    p.add_argument("--bfcl-sets", default="simple_python,multiple,irrelevance")
    p.add_argument("--decode-step-ms", type=float, default=11.5,
                   help="reference decode step (DESIGN.md: llama.cpp Q4_0 tg 86.6 tok/s, random Qwen3-MoE)")
    p.add_argument("--parts", default="json,sql,bfcl,outlines,regex")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # small ops: thread hand-off costs more than it saves on a shared CPU
    tok = TokenizerInfo.from_file(qwen_tokenizer_json(), QWEN_EOS_IDS)
    t0 = time.perf_counter()
    tok.llg  # noqa: B018  (build once, outside the timings)
    results: dict = {"tokenizer": {"vocab": tok.vocab_size, "logits": QWEN_MODEL_VOCAB,
                                   "llg_build_s": time.perf_counter() - t0},
                     "args": {k: str(v) for k, v in vars(args).items()}}
    parts = set(args.parts.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    if "json" in parts:
        results["json_schema"] = eval_json(tok, args)
        results["overhead"] = overhead_summary(results["json_schema"], args.decode_step_ms)
    if "sql" in parts:
        results["sql"] = eval_sql(tok, args)
    if "bfcl" in parts:
        results["bfcl"] = eval_bfcl(tok, args)
    if "outlines" in parts:
        results["outlines_core"] = eval_outlines(tok, args)
    if "regex" in parts:
        results["regex"] = eval_regex(tok, args)
    path = args.out / "results.json"
    if path.exists() and parts != {"json", "sql", "bfcl", "outlines", "regex"}:  # partial run: update those parts
        results = {**json.loads(path.read_text()), **results}
    path.write_text(json.dumps(results, indent=2, default=str))
    if {"json_schema", "sql", "bfcl"} <= results.keys():
        plot(results, args.out / "results.png")
    print(json.dumps(results.get("overhead", {}), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
