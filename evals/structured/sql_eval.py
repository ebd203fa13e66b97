"""The SQL part of the structured-decoding eval (`run.py --parts sql`): Spider dev gold queries
through grammar, scope guard and validator per dialect, the adversarial set, random walks, compile
and per-step mask cost against the decode step measured in the same run."""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from evals.perf.common import machine_info
from gateway.structured.bitmask import bitmask_words, row_allows
from gateway.structured.constraint import Constraint
from gateway.structured.errors import StructuredOutputError
from gateway.structured.sql_grammar import sql_spec
from gateway.structured.sql_schema import DatabaseSchema, SQLPolicy
from gateway.structured.sql_validate import check_sql
from gateway.structured.vocab import TokenizerInfo

from .common import DATA, _sample, compile_timed, pct
from .sql_walks import random_walks


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
    _decode_steps(llm.engine, [("warm", prompt, SamplingParams(max_tokens=4))], "execution")
    steps: list[float] = []
    for i in range(requests):
        steps += _decode_steps(llm.engine, [(f"step-{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))],
                               "execution")[0]
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
            row["decode_step_ms_p50"] = step
            row["mask_pct_of_step"] = {q: 100 * (row[f"fill_ms_{q}"] + row[f"guard_ms_{q}"]) / step
                                       for q in ("p50", "mean", "p99")}
            row["guard_pct_of_step"] = {q: 100 * row[f"guard_ms_{q}"] / step for q in ("p50", "mean", "p99")}
    return out
