"""Constrained-decoding overhead per decode step, serial vs overlapped with the forward pass.

A stand-in forward pass (matmuls calibrated to --step-ms) runs while BatchMasker.fill_async
computes the next masks in its thread (llguidance drops the GIL); only the apply is exposed.

    PYTHONPATH=. python -m evals.structured.overlap [--step-ms 11.5] [--batch 1 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from gateway.structured.batch import BatchMasker
from gateway.structured.bitmask import allocate_bitmask
from gateway.structured.build import build_constraint, json_schema_spec
from gateway.structured.cache import ConstraintCache
from gateway.structured.vocab import TokenizerInfo

from .qwen_vocab import QWEN_EOS_IDS, QWEN_MODEL_VOCAB, qwen_tokenizer_json


def calibrated_forward(step_ms: float):
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    t0 = time.perf_counter()
    for _ in range(20):
        a @ b
    per = (time.perf_counter() - t0) / 20
    reps = max(1, round(step_ms / 1e3 / per))

    def forward(batch: int) -> torch.Tensor:
        for _ in range(reps):
            a @ b
        return torch.randn(batch, QWEN_MODEL_VOCAB)  # [B, V] logits

    return forward


class Lane:
    """One mode's batch of sequences, kept across interleaved chunks."""

    def __init__(self, batch: int, constraints_for) -> None:
        self.cons = constraints_for(batch)
        self.bitmask = allocate_bitmask(batch, QWEN_MODEL_VOCAB)
        self.ids: list[list[int]] = [[] for _ in range(batch)]


def run(lane: Lane, steps: int, forward, constraints_for, mode: str, masker: BatchMasker) -> list[float]:
    cons, bitmask, ids = lane.cons, lane.bitmask, lane.ids
    batch = len(cons)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        if mode == "overlapped":
            future = masker.fill_async(cons, bitmask)
            logits = forward(batch)
            future.result()
            masker.apply(logits, bitmask)
        elif mode == "serial":
            logits = forward(batch)
            masker.fill(cons, bitmask)
            masker.apply(logits, bitmask)
        else:
            logits = forward(batch)
        tokens = logits.argmax(-1).tolist()
        times.append(time.perf_counter() - t0)
        for b, c in enumerate(cons):
            if c.is_terminated():  # restart a finished sequence so every step stays constrained
                cons[b] = constraints_for(1)[0]
                ids[b] = []
                continue
            ids[b].append(tokens[b])
            c.advance(ids[b])
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--step-ms", type=float, default=11.5)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--out", type=Path, default=Path("evals/structured/results"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    tok = TokenizerInfo.from_file(qwen_tokenizer_json(), QWEN_EOS_IDS)
    rows = [json.loads(line) for line in open("/work/shared/evaldata/jsonschemabench/Glaiveai2K.jsonl")][:64]
    cache = ConstraintCache()
    specs = [json_schema_spec(r["schema"]) for r in rows]
    counter = iter(range(10**9))

    def constraints_for(n: int):
        out = []
        while len(out) < n:
            try:
                out.append(build_constraint(specs[next(counter) % len(specs)], tok, cache=cache))
            except Exception:  # schemas outside the supported set are skipped here
                continue
        return out

    forward = calibrated_forward(args.step_ms)
    masker = BatchMasker(num_threads=1)
    result = {}
    for batch in args.batch:
        modes = ("none", "serial", "overlapped")
        lanes = {m: Lane(batch, constraints_for) for m in modes}
        times: dict[str, list[float]] = {m: [] for m in modes}
        for _ in tqdm(range(args.steps // 10), desc=f"batch {batch}"):  # interleave: load drifts
            for mode in modes:
                times[mode] += run(lanes[mode], 10, forward, constraints_for, mode, masker)
        med = {m: statistics.median(t) * 1e3 for m, t in times.items()}
        result[f"batch_{batch}"] = {
            "step_ms_unconstrained": med["none"], "step_ms_serial": med["serial"],
            "step_ms_overlapped": med["overlapped"],
            "overhead_serial_pct": 100 * (med["serial"] / med["none"] - 1),
            "overhead_overlapped_pct": 100 * (med["overlapped"] / med["none"] - 1),
        }
        print(batch, result[f"batch_{batch}"])
    masker.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "overlap.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
