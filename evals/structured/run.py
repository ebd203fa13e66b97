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

from gateway.structured.bitmask import apply_bitmask_, bitmask_words, row_ids
from gateway.structured.build import json_schema_spec
from gateway.structured.closing import completion_hints, shortest_completion
from gateway.structured.constraint import Constraint
from gateway.structured.errors import StructuredOutputError, UnsupportedSchemaError
from gateway.structured.tools import tool_call_spec
from gateway.structured.validate import validate_json, validate_tool_calls
from gateway.structured.vocab import TokenizerInfo

from .common import DATA, _sample, compile_timed, pct
from .driver import LogitsFn, random_logits
from .engine_overhead import DEMO_MODEL
from .plot import plot
from .qwen_vocab import QWEN_EOS_IDS, QWEN_MODEL_VOCAB, qwen_tokenizer_json
from .splits import splits
from .sql_eval import SQL_DIALECTS, eval_sql

SPLIT_ROWS = splits()
SPLITS = tuple(SPLIT_ROWS)


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
    for split in args.splits.split(","):
        rows = _sample(SPLIT_ROWS[split](), args.schemas_per_split)
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
        rows = _sample(SPLIT_ROWS[split](), args.schemas_per_split)
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
        for row in SPLIT_ROWS[split]():
            for _, sub in walk(row["schema"]):
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
    p.add_argument("--splits", default=",".join(SPLITS), help="the JSON Schema splits to run")
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
        old = json.loads(path.read_text())
        if "json_schema" in results:  # and of the JSON part, the splits it ran
            results["json_schema"] = {**old.get("json_schema", {}), **results["json_schema"]}
            results["overhead"] = overhead_summary(results["json_schema"], args.decode_step_ms)
        results = {**old, **results}
    path.write_text(json.dumps(results, indent=2, default=str))
    if {"json_schema", "sql", "bfcl"} <= results.keys():
        plot(results, args.out / "results.png", SPLITS)
    print(json.dumps(results.get("overhead", {}), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
