"""The race inside the lm_head's call against the lm_head then the race, at the kernel: one temperature row's
`moegate_linear_race` (kernels/bindings.py HeadRaceCall) against `moegate_linear` followed by `moegate_race_sample`
on the row it wrote (the sampler's path, one race thread), and `moegate_linear_first_max` (the greedy pick) beside
them, on a random lm_head of the bench shape [151936, 1024] packed in each format. Calls in blocks of `--calls`,
the three orders rotated block by block (ABC, BCA, CAB), medians per call of each block; the same race inputs
(temperature, key, a counter that advances per call) for both race paths. Writes DIR/race_head_bench.json.

    python -m evals.perf.race_head_bench --formats int8,int4 --blocks 12
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch


def bench(fmt: str, vocab: int, hidden: int, threads: int, temperature: float, blocks: int, calls: int) -> dict:
    from kernels.bindings import HeadRaceCall, LinearCall
    from kernels.fused_moe import kernel_library
    from kernels.linear import PackedLinear
    from kernels.race_noise import RaceSampler

    g = torch.Generator().manual_seed(0)
    packed = PackedLinear.pack(torch.randn(vocab, hidden, generator=g) * 0.05, fmt, None if fmt == "fp32" else 32)
    x = torch.randn(1, hidden, generator=g)
    out = torch.empty(1, packed.padded_out)
    lib = kernel_library()
    first = torch.empty(1, dtype=torch.int64)
    call = LinearCall(lib, packed, x, out, threads, first)
    race = HeadRaceCall(call)
    sampler = RaceSampler()
    row = out[0, :vocab].numpy()
    race.temps[0], race.keys[0] = temperature, 12345
    counter = [0]

    def head_then_race() -> None:
        call(1)
        sampler(row, temperature, 12345, counter[0])
        counter[0] += 1

    def race_in_head() -> None:
        race.counters[0] = counter[0]
        race(1, vocab)
        counter[0] += 1

    def greedy_pick() -> None:
        call.picking(1)

    paths = {"head_then_race": head_then_race, "race_in_head": race_in_head, "head_first_max": greedy_pick}
    for fn in paths.values():  # warm-up, and the two race paths agree
        fn()
    race.counters[0] = 7
    race(1, vocab)
    assert (int(race.picks[0]), float(race.best[0])) == sampler(row, temperature, 12345, 7)
    names = list(paths)
    times: dict[str, list[float]] = {n: [] for n in names}
    for b in range(blocks):
        for name in names[b % 3:] + names[:b % 3]:
            per = []
            for _ in range(calls):
                t = time.perf_counter()
                paths[name]()
                per.append(time.perf_counter() - t)
            times[name].append(1e3 * statistics.median(per))
    base = statistics.median(times["head_then_race"])
    return {"format": fmt, "blocks_ms": times,
            "median_ms": {n: statistics.median(v) for n, v in times.items()},
            "ratio_to_head_then_race": {n: statistics.median(v) / base for n, v in times.items()}}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="int8,int4")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--blocks", type=int, default=12)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--out", default="evals/out/race_head_bench")
    args = ap.parse_args(argv)
    from evals.perf.common import machine_info

    load_before = os.getloadavg()
    runs = [bench(f, args.vocab, args.hidden, args.threads, args.temperature, args.blocks, args.calls)
            for f in args.formats.split(",")]
    res = {"runs": runs, "config": vars(args), "machine": machine_info(),
           "load": {"before": load_before, "after": os.getloadavg()}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "race_head_bench.json").write_text(json.dumps(res, indent=2))
    for r in runs:
        print(r["format"], {k: round(v, 3) for k, v in r["median_ms"].items()},
              {k: round(v, 3) for k, v in r["ratio_to_head_then_race"].items()})
    print("load", load_before, os.getloadavg())
    return res


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
