"""Constrained-decoding overhead per decode step through the engine's sampler (engine/sampler.py).

A stand-in forward pass (matmuls calibrated to --step-ms) then `engine.sampler.sample` over B
sequences, four ways: unconstrained; `per_row` (each Constraint a plain logits processor: advance,
fill, apply per row); `batched` (Constraints with a BatchMasker: one `masks` call per step, the
gateway's CPU default); `prefetched` (as batched, and the next masks computed in a thread right after
sampling, while the next forward runs: llguidance drops the GIL; the default with CUDA).

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

from engine.sampler import sample
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from gateway.structured.batch import BatchMasker
from gateway.structured.build import build_constraint, json_schema_spec
from gateway.structured.cache import ConstraintCache
from gateway.structured.vocab import TokenizerInfo

from .qwen_vocab import QWEN_EOS_IDS, QWEN_MODEL_VOCAB, qwen_tokenizer_json

QWEN_TOKENIZER_VOCAB = 151669  # ids past it are padded lm_head rows (never sampled)


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

    def __init__(self, batch: int, constraints_for, mode: str, masker: BatchMasker | None) -> None:
        self.mode, self.masker, self.constraints_for = mode, masker, constraints_for
        self.seqs = [self._seq(i) for i in range(batch)]

    def _seq(self, i: int) -> Sequence:
        procs = []
        if self.mode != "none":
            c = self.constraints_for(1)[0]
            c.mask_batcher = self.masker
            procs = [c]
        return Sequence(f"s{i}", [0], SamplingParams(max_tokens=10**6, logits_processors=procs))


def run(lane: Lane, steps: int, forward) -> list[float]:
    seqs = lane.seqs
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = forward(len(seqs))  # [B, V]
        tokens = sample(logits, seqs, QWEN_TOKENIZER_VOCAB)
        times.append(time.perf_counter() - t0)
        for b, (seq, token) in enumerate(zip(seqs, tokens, strict=True)):
            # (not Constraint.is_terminated(): its next mask may be computing in the prefetch thread)
            if not isinstance(token, int) or token in QWEN_EOS_IDS or len(seq.output_token_ids) >= 250:
                seqs[b] = lane._seq(b)  # restart a finished sequence so every step stays constrained
            else:
                seq.output_token_ids.append(token)
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
                out.append(build_constraint(specs[next(counter) % len(specs)], tok, cache=cache, max_tokens=256))
            except Exception:  # schemas outside the supported set are skipped here
                continue
        return out

    forward = calibrated_forward(args.step_ms)
    maskers = {"none": None, "per_row": None, "batched": BatchMasker(num_threads=2, prefetch=False),
               "prefetched": BatchMasker(num_threads=2, prefetch=True)}
    result = {"step_ms_target": args.step_ms, "note": "median step = calibrated forward + engine.sampler.sample; "
              "per_row: Constraint as a logits processor; batched: one BatchMasker call per step; "
              "prefetched: batched + next masks computed during the forward"}
    for batch in args.batch:
        lanes = {m: Lane(batch, constraints_for, m, masker) for m, masker in maskers.items()}
        times: dict[str, list[float]] = {m: [] for m in maskers}
        for _ in tqdm(range(args.steps // 10), desc=f"batch {batch}"):  # interleave: load drifts
            for mode in maskers:
                times[mode] += run(lanes[mode], 10, forward)
        med = {m: statistics.median(t) * 1e3 for m, t in times.items()}
        result[f"batch_{batch}"] = {
            **{f"step_ms_{m}": med[m] for m in maskers},
            **{f"overhead_{m}_pct": 100 * (med[m] / med["none"] - 1) for m in maskers if m != "none"},
            "prefetch_hits": maskers["prefetched"].prefetch_hits,
        }
        print(batch, result[f"batch_{batch}"])
    for masker in maskers.values():
        if masker is not None:
            masker.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "overlap.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
