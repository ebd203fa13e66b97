"""Prefix cache benchmark: TTFT of a 2k-token shared prefix per serving tier, and a multi-turn agent trace's hit rate.

TTFT = add_request to the first sampled token, for the shared prefix plus a fresh 16-token suffix (so only
the prefix can hit). Tiers: cold (no cache), device (blocks still in the KV pool), RAM (device blocks
demoted), disk (a restarted engine, RAM off), redis (another replica, RAM and disk off; needs
redis-server on PATH or --redis-url). Writes prefix_cache_bench.json and .png to --out.
Usage: PYTHONPATH=. python evals/perf/prefix_cache_bench.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams
from evals.perf.common import cpu_busy_fraction
from modeltools.random_checkpoint import write_random_checkpoint

MODEL = dict(hidden_size=512, num_layers=4, num_experts=16, top_k=4, moe_intermediate_size=256,
             num_heads=8, num_kv_heads=2, vocab="bpe", dtype="float32", seed=0)


def tokens(n: int, seed: int, vocab: int) -> list[int]:
    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def ttft(engine: LLMEngine, prompt: list[int], salt: str = "tenant") -> tuple[float, int, dict]:
    """Seconds to the first token, prompt tokens served from the cache, blocks per tier."""
    rid = f"r{time.monotonic_ns()}"
    start = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True), cache_salt=salt)
    while engine.has_work():
        for out in engine.step():
            if out.request_id == rid and out.token_ids:
                elapsed = time.perf_counter() - start
                while engine.has_work():
                    engine.step()
                return elapsed, out.num_cached_tokens, out.cache_hits or {}
    raise RuntimeError("no token")


def measure_tiers(model: Path, work: Path, prefix_len: int, reps: int, redis_url: str | None, vocab: int) -> dict:
    base = dict(model=str(model), progress=False, mask_unused_vocab=False, max_num_batched_tokens=512)
    prefix = tokens(prefix_len, 1, vocab)
    seed = iter(range(1000, 100000))
    suffix = lambda: tokens(16, next(seed), vocab)  # noqa: E731
    results: dict[str, dict] = {}

    def record(name: str, runs: list[tuple[float, int, dict]]) -> None:
        times = [t for t, _, _ in runs]
        results[name] = {"ttft_s": statistics.median(times), "runs_s": times,
                         "cached_tokens": runs[-1][1], "hits": runs[-1][2]}

    cold_engine = LLMEngine(EngineConfig(**base, prefix_cache=False))
    ttft(cold_engine, tokens(64, 7, vocab))  # warm-up
    record("cold", [ttft(cold_engine, prefix + suffix()) for _ in tqdm(range(reps), desc="cold")])

    disk_dir = work / "disk"
    full = LLMEngine(EngineConfig(**base, disk_cache_dir=str(disk_dir), redis_url=redis_url))
    ttft(full, tokens(64, 7, vocab))
    ttft(full, prefix + suffix())  # populate
    record("device", [ttft(full, prefix + suffix()) for _ in tqdm(range(reps), desc="device hit")])
    runs = []
    for _ in tqdm(range(reps), desc="RAM hit"):
        full.prefix_cache.evict("device")
        runs.append(ttft(full, prefix + suffix()))
    record("ram", runs)
    full.close()  # device + RAM blocks written to disk (and redis)

    disk_only = LLMEngine(EngineConfig(**base, ram_cache_gib=0, disk_cache_dir=str(disk_dir)))  # a restart
    runs = []
    for _ in tqdm(range(reps), desc="disk hit"):
        disk_only.prefix_cache.evict("device")
        runs.append(ttft(disk_only, prefix + suffix()))
    record("disk", runs)
    results["disk"]["stats"] = disk_only.cache_stats()["disk"]

    if redis_url:
        replica = LLMEngine(EngineConfig(**base, ram_cache_gib=0, redis_url=redis_url))  # another replica
        runs = []
        for _ in tqdm(range(reps), desc="redis hit"):
            replica.prefix_cache.evict("device")
            runs.append(ttft(replica, prefix + suffix()))
        record("redis", runs)
        results["redis"]["stats"] = replica.cache_stats()["redis"]
    cold = results["cold"]["ttft_s"]
    for r in results.values():
        r["speedup_vs_cold"] = cold / r["ttft_s"]
    return results


def agent_trace(model: Path, sessions: int, turns: int, vocab: int) -> dict:
    """Agents of two tenants: each tenant's agents share a system prompt + tool list; every turn resends the
    whole conversation (previous prompt + answer + a tool result) and generates an answer."""
    engine = LLMEngine(EngineConfig(model=str(model), progress=False, mask_unused_vocab=False))
    systems = {t: tokens(1024, 10 + t, vocab) for t in range(2)}
    convs = {s: list(systems[s % 2]) + tokens(40, 100 + s, vocab) for s in range(sessions)}
    per_turn = []
    total = cached = 0
    for turn in tqdm(range(turns), desc="agent trace"):
        turn_total = turn_cached = 0
        for s in range(sessions):
            rid = f"s{s}t{turn}"
            engine.add_request(rid, convs[s], SamplingParams(max_tokens=24, ignore_eos=True), cache_salt=f"tenant{s % 2}")
            while engine.has_work():
                for out in engine.step():
                    if out.finished:
                        turn_total += len(out.prompt_token_ids)
                        turn_cached += out.num_cached_tokens
                        convs[s] = convs[s] + out.token_ids + tokens(60, 1000 * s + turn, vocab)  # + tool result
        per_turn.append(turn_cached / turn_total)
        total, cached = total + turn_total, cached + turn_cached
    return {"sessions": sessions, "turns": turns, "prompt_tokens": total, "cached_tokens": cached,
            "hit_rate": cached / total, "hit_rate_per_turn": per_turn, "stats": engine.cache_stats()}


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tiers = report["tiers"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(tiers)
    vals = [tiers[n]["ttft_s"] * 1000 for n in names]
    bars = a.bar(names, vals, color=["#888"] + ["#3a7"] * (len(names) - 1))
    for bar, n in zip(bars, names, strict=True):
        a.annotate(f"{tiers[n]['speedup_vs_cold']:.1f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                   ha="center", va="bottom", fontsize=9)
    a.set_yscale("log")
    a.set_ylabel("TTFT (ms, log)")
    a.set_title(f"TTFT, {report['prefix_tokens']}-token shared prefix")
    trace = report["agent_trace"]
    b.plot(range(1, len(trace["hit_rate_per_turn"]) + 1), trace["hit_rate_per_turn"], marker="o")
    b.set_ylim(0, 1)
    b.set_xlabel("turn")
    b.set_ylabel("prompt tokens served from cache")
    b.set_title(f"agent trace: {trace['hit_rate']:.0%} overall")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("evals/out/prefix_cache"))
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--redis-url", help="default: start a redis-server on a free port if one is on PATH")
    ap.add_argument("--quick", action="store_true", help="512-token prefix, 1 rep, short trace")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: on a shared 2-core box more threads make OpenMP barriers dominate)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        args.prefix_tokens, args.reps = 512, 1
    args.out.mkdir(parents=True, exist_ok=True)
    busy = cpu_busy_fraction()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = write_random_checkpoint(work / "model", "qwen3_moe", **MODEL)
        vocab = json.loads((model / "config.json").read_text())["vocab_size"]
        server = None
        redis_url = args.redis_url
        if redis_url is None and shutil.which("redis-server"):
            from tests.gateway.redis_process import RedisProcess

            server = RedisProcess(work)
            server.start()
            redis_url = server.url
        try:
            tiers = measure_tiers(model, work, args.prefix_tokens, args.reps, redis_url, vocab)
            trace = agent_trace(model, sessions=2 if args.quick else 4, turns=3 if args.quick else 5, vocab=vocab)
        finally:
            if server is not None:
                server.kill()
    report = {
        "model": MODEL, "prefix_tokens": args.prefix_tokens, "reps": args.reps, "device": "cpu",
        "torch_threads": torch.get_num_threads(), "cpu_busy_before": round(busy, 2),
        "cpu_busy_after": round(cpu_busy_fraction(), 2), "machine": platform.processor() or platform.machine(),
        "tiers": tiers, "agent_trace": trace,
    }
    (args.out / "prefix_cache_bench.json").write_text(json.dumps(report, indent=2))
    plot(report, args.out / "prefix_cache_bench.png")
    print(json.dumps({n: {"ttft_ms": round(t["ttft_s"] * 1000, 1), "speedup": round(t["speedup_vs_cold"], 1)}
                      for n, t in tiers.items()}))
    print(f"agent trace hit rate {trace['hit_rate']:.3f} per turn {[round(x, 3) for x in trace['hit_rate_per_turn']]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
