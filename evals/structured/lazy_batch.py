"""Constraint work per decode step at batch B without the model: the engine's sampler (engine/sampler.py `sample`)
on B constrained rows whose logits are noise plus `--boost` on each row's gold next token (the competent-model
proxy of gold_replay.py), lazy verification on, timed per step while all B rows decode (after the first step,
and after one uncounted repeat). The forward pass is left
out, so the figure is the mask work alone (checks, fills, advance) and many more steps fit in a run than in
engine_overhead.py; compare it with engine_overhead's unconstrained step.

    PYTHONPATH=. python -m evals.structured.lazy_batch [--kinds sql,json] [--batch 8] [--repeats 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from evals.perf.common import machine_info
from evals.structured.engine_overhead import DEFAULT_MODEL, _specs


def measure(model: Path, kind: str, batch: int, repeats: int, boost: float, max_tokens: int) -> dict:
    from engine.sampler import sample
    from engine.sampling_params import SamplingParams
    from engine.sequence import Sequence
    from gateway.structured import closing as closing_mod
    from gateway.structured.batch import BatchMasker
    from gateway.structured.build import build_constraint
    from gateway.structured.cache import ConstraintCache
    from gateway.structured.vocab import TokenizerInfo

    config = json.loads((model / "config.json").read_text())
    eos = (151643, 151645)
    info = TokenizerInfo.from_file(str(model / "tokenizer.json"), eos)
    cache = ConstraintCache()
    specs, _ = _specs(kind, 2 * batch, 1, info, cache)
    masker = BatchMasker(prefetch=False)
    gen = torch.Generator().manual_seed(0)
    steps, hits, fallbacks = [], 0, 0
    plan = {"plan_searches": 0, "plan_reuses": 0, "plan_search_s": 0.0}
    # the first repeat warms the caches a long-running engine has warm (start paths); it is not counted
    for repeat in range(repeats + 1):
        for group in (specs[:batch], specs[batch : 2 * batch]):
            if hasattr(closing_mod, "drop_shared_paths"):  # (start paths stay warm; this output's are new)
                closing_mod.drop_shared_paths()
            cons = [
                build_constraint(
                    s, info, eos_ids=eos, cache=cache, max_tokens=max_tokens, mask_batcher=masker
                )
                for s, _ in group
            ]
            seqs = [
                Sequence(f"r{j}", [1], SamplingParams(max_tokens=max_tokens, logits_processors=[c]))
                for j, c in enumerate(cons)
            ]
            for step in range(max_tokens):
                if any(s.output_token_ids and s.output_token_ids[-1] in eos for s in seqs):
                    break  # (only steps where every row decodes, as engine_overhead counts them)
                logits = torch.randn(len(seqs), config["vocab_size"], generator=gen)  # [B, V]
                for j, (_, gold) in enumerate(group):
                    if step < len(gold):
                        logits[j, gold[step]] += boost
                t0 = time.perf_counter()
                tokens = sample(logits, seqs, info.vocab_size)
                # (step 0 samples the prefill's token, which engine_overhead leaves out too)
                if repeat and step:
                    steps.append(time.perf_counter() - t0)
                for s, t in zip(seqs, tokens, strict=True):
                    s.output_token_ids.append(t)
            hits += sum(c.lazy_hits for c in cons) if repeat else 0
            fallbacks += sum(c.lazy_fallbacks for c in cons) if repeat else 0
            for name in plan:  # (every step of the counted repeats, where all rows decode or not)
                plan[name] += sum(getattr(c, name, 0) for c in cons) if repeat else 0
    masker.close()
    return {
        "steps": len(steps),
        "ms_p50": 1e3 * statistics.median(steps),
        "ms_mean": 1e3 * statistics.fmean(steps),
        "lazy_hits": hits,
        "lazy_fallbacks": fallbacks,
        # the closing planner: completion searches run, checks answered by the last path found, seconds searching
        **plan,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--kinds", default="sql,json")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--boost", type=float, default=30.0)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("evals/structured/results"))
    p.add_argument("--name", default="lazy_batch")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    result = {"machine": machine_info(), "batch": args.batch}
    for kind in args.kinds.split(","):
        result[kind] = measure(args.model, kind, args.batch, args.repeats, args.boost, args.max_tokens)
        print(kind, result[kind], flush=True)
    result["machine_after"] = machine_info()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
