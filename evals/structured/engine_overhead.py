"""Constrained-decoding overhead measured in the real engine: decode-step time with and without a JSON
Schema constraint on the same model, prompts and budgets, requests interleaved so load drifts cancel.

The constraint's work per step is the token advance, the mask fill (llguidance), the closing planner's
occasional search and the mask apply (compiled kernel); all of it runs inside `engine.step()`, so the
difference of median decode-step times is the whole overhead a user pays.

    PYTHONPATH=. python -m evals.structured.engine_overhead [--model DIR] [--requests 24]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from evals.perf.common import machine_info, save_bar_plot

DEFAULT_MODEL = Path("evals/out/models/bench-ref")  # engine_bench's reference model (Qwen vocabulary)
DEMO_MODEL = Path("engine/assets/demo-moe")
SCHEMAS = Path("/work/shared/evaldata/jsonschemabench/Glaiveai2K.jsonl")


def _decode_steps(engine, request_id: str, prompt: list[int], params, mode: str) -> list[float]:
    """Seconds of each engine step after the first (the first one runs the prefill)."""
    engine.add_request(request_id, prompt, params, mode=mode)
    times = []
    while engine.has_work():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times[1:]


def measure(model: Path, requests: int, max_tokens: int, modes: tuple[str, ...], fmt: str, lm_head: str,
            dense: str) -> dict:
    from engine.experts import PlacementConfig
    from engine.llm_engine import LLM
    from engine.sampling_params import SamplingParams
    from gateway.structured.build import build_constraint, json_schema_spec
    from gateway.structured.cache import ConstraintCache
    from gateway.structured.errors import StructuredOutputError
    from gateway.structured.vocab import TokenizerInfo

    llm = LLM(str(model), placement=PlacementConfig(fast_format=fmt, exact_format=fmt), prefix_cache=False,
              fast_lm_head=lm_head, fast_dense=dense, progress=False)
    engine, tok = llm.engine, llm.tokenizer
    eos = tuple(tok.eos_token_ids)
    info = TokenizerInfo.from_file(str(model / "tokenizer.json"), eos)
    cache = ConstraintCache()
    specs = []
    for line in open(SCHEMAS):
        spec = json_schema_spec(json.loads(line)["schema"])
        try:
            build_constraint(spec, info, cache=cache)
        except StructuredOutputError:
            continue
        specs.append(spec)
        if len(specs) == requests:
            break
    prompt = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "Reply with the JSON object for today's order ticket."}]))
    _decode_steps(engine, "warm", prompt, SamplingParams(max_tokens=4), modes[0])  # kernel build, first touch
    out: dict = {}
    for mode in modes:
        steps: dict[str, list[float]] = {"none": [], "constrained": []}
        for i, spec in enumerate(tqdm(specs, desc=f"requests ({mode})")):
            constraint = build_constraint(spec, info, eos_ids=eos, cache=cache, max_tokens=max_tokens)
            runs = [("none", SamplingParams(max_tokens=max_tokens, ignore_eos=True)),
                    ("constrained", SamplingParams(max_tokens=max_tokens, logits_processors=[constraint]))]
            for name, params in runs if i % 2 == 0 else runs[::-1]:  # alternate the order: drift cancels
                steps[name] += _decode_steps(engine, f"{mode}-{name}-{i}", prompt, params, mode)
        med = {k: statistics.median(v) * 1e3 for k, v in steps.items()}
        mean = {k: statistics.fmean(v) * 1e3 for k, v in steps.items()}
        out[mode] = {"decode_steps": {k: len(v) for k, v in steps.items()},
                     "step_ms_p50_unconstrained": med["none"], "step_ms_p50_constrained": med["constrained"],
                     "overhead_pct": 100 * (med["constrained"] / med["none"] - 1),
                     "step_ms_mean_unconstrained": mean["none"], "step_ms_mean_constrained": mean["constrained"],
                     "overhead_mean_pct": 100 * (mean["constrained"] / mean["none"] - 1)}
        print(mode, out[mode])
    engine.runner.shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL if DEFAULT_MODEL.exists() else DEMO_MODEL)
    p.add_argument("--requests", type=int, default=24, help="JSON schemas (Glaive, first compilable ones)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--modes", default="execution,exploration")
    p.add_argument("--format", default="int4", help="expert format of the engine (fast and exact)")
    p.add_argument("--lm-head", default="int4", help="exploration lm_head format (engine_bench's best config)")
    p.add_argument("--fast-dense", default="int8", help="exploration attention format")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("evals/structured/results"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = {"model": str(args.model), "requests": args.requests, "max_tokens": args.max_tokens,
              "format": args.format, "lm_head": args.lm_head, "fast_dense": args.fast_dense,
              "machine": machine_info(),
              "modes": measure(args.model, args.requests, args.max_tokens, tuple(args.modes.split(",")),
                               args.format, args.lm_head, args.fast_dense)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "engine_overhead.json").write_text(json.dumps(result, indent=2))
    save_bar_plot(args.out / "engine_overhead.png", "decode step p50 (ms): unconstrained vs JSON Schema constrained",
                  {mode: {"unconstrained": r["step_ms_p50_unconstrained"], "constrained": r["step_ms_p50_constrained"]}
                   for mode, r in result["modes"].items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
