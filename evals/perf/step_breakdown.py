"""Where a decode step's time goes: the compiled kernels against everything around them (scheduling, the
ForwardBatch, the Python between kernel calls, sampling, stop checks, detokenizing, outputs).

One request on the bench checkpoint (int4 experts and attention, int8 lm_head by default), or `--rows` requests
decoding together, greedy in exploration mode by default (`--mode execution`, `--temperature T`: seeded sampling); per
decode step:
  kernel      wall time inside the compiled entry points (`moegate_*`: decoder layers, norms, lm_head)
  outside     step - kernel: the engine's own cost per step (#26's "step + sampling overhead")
  overhead    step - forward - logits: the older split, which counts the Python inside the forward as model time
  sample      `MultiTokenDecoder.choose` (sampling, drafts verified); schedule, batch (the ForwardBatch), advance
              (text, stop checks, mode switches per token), extend (forced tokens / drafts), output (RequestOutput)
  forward_python  forward + logits - kernel: the Python of the forward around its kernel calls
  unsplit     outside minus all of the above: the step's own lines between them
  forward     the decoder layers; a fused decode step (`ModelRunner._decode_step`: token ids to logits in two kernel
              calls, no ForwardBatch) counts whole here, its lm_head included (logits and batch then read 0)
  *_per_token those divided by the rows the step decoded (equal to them at one row)
Writes DIR/step_breakdown.json. Two trees side by side: evals/perf/compare_trees.py, e.g.
    python -m evals.perf.compare_trees --baseline BASE --result step_breakdown.json --out evals/perf/results/NAME \\
        -- python $PWD/evals/perf/step_breakdown.py --model DIR
(the script path of this tree, so both trees are measured by the same code).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

_MISSING = object()
KERNEL_ENTRY_POINTS = ("moegate_decode_layer", "moegate_decode_stack", "moegate_decode_step", "moegate_linear",
                       "moegate_linear_first_max", "moegate_linear_race", "moegate_rms_norm",
                       "moegate_rope", "moegate_fused_moe", "moegate_apply_bitmask")


def decode_step_breakdown(engine, prompt: list[int], params, mode: str = "exploration", rows: int = 1
                          ) -> dict[str, float]:
    """Median milliseconds per decode step of one request (`rows` > 1: that many, their prompts `prompt` rotated,
    and only the steps where every one of them decodes are counted), split into the model's forward (decoder layers),
    the logits (final norm + lm_head), the time inside the compiled kernels and everything else the step
    does ("overhead" = step - forward - logits; "outside" = step - kernel). "overhead_cpu" / "outside_cpu" are
    the same splits in CPU time of the stepping thread: on a shared machine the wall-clock figures also count
    the time the thread waited for a core."""
    import engine.llm_engine as llm_engine

    runner, spent = engine.runner, {"forward": 0.0, "logits": 0.0, "sample": 0.0, "schedule": 0.0, "batch": 0.0,
                                    "kernel": 0.0, "advance": 0.0, "extend": 0.0, "output": 0.0}
    cpu = {"forward": 0.0, "logits": 0.0, "kernel": 0.0}

    def timed(key: str, fn):
        def wrapper(*a, **kw):
            t, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                spent[key] += time.perf_counter() - t
                if key in cpu:
                    cpu[key] += time.thread_time() - c
        return wrapper

    model = runner.model
    patches = [(runner, "model", _TimedModel(model, timed)), (model, "compute_logits", timed("logits", model.compute_logits)),
               (engine.decoder, "choose", timed("sample", engine.decoder.choose)),  # sampling, drafts verified
               (engine.scheduler, "schedule", timed("schedule", engine.scheduler.schedule)),
               (runner, "build_batch", timed("batch", runner.build_batch)),
               (engine, "_advance", timed("advance", engine._advance)),  # text, stop checks, mode switches per token
               (engine.decoder, "extend", timed("extend", engine.decoder.extend)),  # forced tokens / drafts
               (llm_engine, "make_output", timed("output", llm_engine.make_output))]
    if hasattr(runner, "_decode_step"):  # the fused decode step: its inputs, stack and lm_head timed as the forward
        def decode_step(chunks, find=runner._decode_step):
            step = find(chunks)
            return None if step is None else timed("forward", step)

        patches.append((runner, "_decode_step", decode_step))
    patches += [(lib, name, timed("kernel", getattr(lib, name))) for lib in _kernel_libraries()
                for name in KERNEL_ENTRY_POINTS if hasattr(lib, name)]
    saved = [(obj, name, vars(obj)[name] if name in vars(obj) else _MISSING) for obj, name, _ in patches]
    steps: list[dict[str, float]] = []
    try:
        for obj, name, new in patches:
            setattr(obj, name, new)
        for r in range(rows):
            engine.add_request(f"breakdown-{r}", prompt[r:] + prompt[:r], params, mode)
        sched = engine.scheduler
        while engine.has_work():
            decoding = not sched.waiting and len(sched.running) == rows and all(
                s.num_tokens - s.num_computed == 1 for s in sched.running)  # else a prefill is in the step
            for d in (spent, cpu):
                d.update(dict.fromkeys(d, 0.0))
            t, c = time.perf_counter(), time.thread_time()
            engine.step()
            total, total_cpu = time.perf_counter() - t, time.thread_time() - c
            if not decoding:
                continue
            row = {k: 1e3 * v for k, v in spent.items()}
            row["step"] = 1e3 * total
            row["overhead"] = row["step"] - row["forward"] - row["logits"]
            row["overhead_cpu"] = 1e3 * (total_cpu - cpu["forward"] - cpu["logits"])
            row["outside"] = row["step"] - row["kernel"]
            row["outside_cpu"] = 1e3 * (total_cpu - cpu["kernel"])
            # the forward's own Python (a fused decode step's inputs and calls) and what no timer covers
            row["forward_python"] = row["forward"] + row["logits"] - row["kernel"]
            row["unsplit"] = row["outside"] - row["forward_python"] - sum(
                row[k] for k in ("sample", "schedule", "batch", "advance", "extend", "output"))
            row.update({f"{k}_per_token": row[k] / rows for k in ("step", "outside", "outside_cpu", "sample")})
            steps.append(row)
    finally:
        for obj, name, old in saved:
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
    return {k: statistics.median(r[k] for r in steps) for k in steps[0]} if steps else {}


def _kernel_libraries() -> list:
    """Every loaded compiled kernel library (ctypes.CDLL): their entry points are what `kernel` times."""
    from kernels import build

    return [lib for lib in build._loaded.values() if lib is not None]


class _TimedModel:
    """The runner's model with its forward call timed (attributes pass through)."""

    def __init__(self, model, timed) -> None:
        self._model, self._call = model, timed("forward", model.__call__)

    def __call__(self, *a, **kw):
        return self._call(*a, **kw)

    def __getattr__(self, name: str):
        return getattr(self._model, name)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="checkpoint dir (`moegate model init-random --preset bench`)")
    ap.add_argument("--out", default="evals/out/step_breakdown")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--format", default="int4", help="routed experts")
    ap.add_argument("--lm-head", default="int8")
    ap.add_argument("--fast-dense", default="int4", help="attention projections")
    ap.add_argument("--requests", type=int, default=3, help="decode runs measured; medians over all their steps")
    ap.add_argument("--rows", type=int, default=1, help="requests decoding together in each run (the batch's rows)")
    ap.add_argument("--mode", default="exploration", choices=("exploration", "execution"))
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sampling, seeded per request")
    args = ap.parse_args(argv)
    import torch

    from engine.experts import PlacementConfig
    from engine.llm_engine import LLM
    from engine.sampling_params import SamplingParams
    from evals.perf.common import machine_info

    load_before = os.getloadavg()[0]
    placement = PlacementConfig(fast_format=args.format, exact_format=args.format)
    blocks = args.rows * -(-(args.prompt_len + args.decode + 1) // 16)  # 16-token blocks
    llm = LLM(args.model, dtype="float32", placement=placement, num_kv_blocks=max(64, blocks), prefix_cache=False,
              fast_lm_head=args.lm_head, fast_dense=args.fast_dense, progress=False)
    vocab = llm.engine.model_config.vocab_size
    prompt = torch.randint(0, min(vocab, 150000), (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=args.decode + 1, ignore_eos=True, temperature=args.temperature,
                            seed=0 if args.temperature else None)
    decode_step_breakdown(llm.engine, prompt[:16], replace(params, max_tokens=4), args.mode, args.rows)  # warm-up
    runs = [decode_step_breakdown(llm.engine, prompt, params, args.mode, args.rows) for _ in range(args.requests)]
    res = {"decode_step_ms": {k: statistics.median(r[k] for r in runs) for k in runs[0]},
           "config": {k: getattr(args, k) for k in ("prompt_len", "decode", "format", "lm_head", "fast_dense", "rows", "mode",
                                                    "temperature")},
           "runs": runs, "machine": machine_info(), "load": {"before": load_before, "after": os.getloadavg()[0]}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_breakdown.json").write_text(json.dumps(res, indent=2))
    print(json.dumps({k: round(v, 3) for k, v in res["decode_step_ms"].items()}))
    return res


if __name__ == "__main__":
    main()
