"""Gateway overhead: latency added by HTTP + auth + policy + classification + audit beyond engine time.

Starts the real app (uvicorn on loopback) and, on the same AsyncLLM, times N pairs of identical greedy
requests: one straight through `AsyncLLM.generate`, one through `POST /v1/chat/completions` (or
`/v1/completions`). The added latency of a pair is HTTP minus direct. Writes gateway_overhead.json and
.png to --out.

    python -m evals.perf.gateway_overhead --model DIR --n 200 --max-tokens 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from tqdm.auto import tqdm

from evals.perf.common import free_port, machine_info, serve_in_thread


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _summary(xs: list[float]) -> dict:
    ms = [x * 1000 for x in xs]
    return {"p50_ms": round(_percentile(ms, 0.5), 3), "p90_ms": round(_percentile(ms, 0.9), 3),
            "p99_ms": round(_percentile(ms, 0.99), 3), "mean_ms": round(statistics.fmean(ms), 3),
            "min_ms": round(min(ms), 3)}


def start_server(model: str, state_dir: Path):
    from gateway.settings import Settings

    settings = Settings(model=model, port=free_port(), state_dir=state_dir, kv_cache_gib=0.1, max_queue=1024)
    return serve_in_thread(settings)


def run(model: str, n: int, max_tokens: int, endpoint: str, out: Path) -> dict:
    from engine.sampling_params import SamplingParams

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        server, thread, app, url = start_server(model, Path(tmp))
        try:
            state = app.state.moegate
            llm, tok = state.llm, state.llm.tokenizer
            messages = [{"role": "user", "content": "Summarise the quarter's revenue growth in one line."}]
            if endpoint == "chat":
                path, body = "/v1/chat/completions", {"messages": messages}
                ids = tok.encode(tok.apply_chat_template(messages))
            else:
                ids = tok.encode("The spread between bid and ask")
                path, body = "/v1/completions", {"prompt": ids}
            body = {**body, "model": state.settings.model_name, "max_tokens": max_tokens, "temperature": 0}
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
            loop = asyncio.new_event_loop()

            async def direct(i: int) -> tuple[float, int]:
                t0 = time.perf_counter()
                count = 0
                async for o in llm.generate(f"bench-{i}", ids, params, "exploration", cache_salt="dev"):
                    count = len(o.token_ids)
                return time.perf_counter() - t0, count

            http = httpx.Client(base_url=url, headers={"Authorization": "Bearer bench"}, timeout=120)
            for i in range(3):  # warm both paths
                loop.run_until_complete(direct(-1 - i))
                http.post(path, json=body).raise_for_status()
            d_times, h_times, tokens = [], [], set()
            for i in tqdm(range(n), desc=f"gateway overhead ({endpoint})"):
                pair = []
                for which in (("direct", "http") if i % 2 == 0 else ("http", "direct")):
                    if which == "direct":
                        dt, count = loop.run_until_complete(direct(i))
                        d_times.append(dt)
                    else:
                        t0 = time.perf_counter()
                        r = http.post(path, json=body)
                        r.raise_for_status()
                        h_times.append(time.perf_counter() - t0)
                        count = r.json()["usage"]["completion_tokens"]
                    pair.append(count)
                tokens.update(pair)
            http.close()
            loop.close()
        finally:
            server.should_exit = True
            thread.join(30)
    added = [h - d for h, d in zip(h_times, d_times, strict=True)]
    result = {"endpoint": endpoint, "n": n, "max_tokens": max_tokens, "completion_tokens": sorted(tokens),
              "model": model, "direct": _summary(d_times), "http": _summary(h_times), "added": _summary(added),
              "machine": machine_info()}
    (out / f"gateway_overhead_{endpoint}.json").write_text(json.dumps(result, indent=2))
    _plot(out / f"gateway_overhead_{endpoint}.png", added, result)
    return result


def _plot(path: Path, added: list[float], result: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = sorted(x * 1000 for x in added)
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(ms, [i / len(ms) for i in range(1, len(ms) + 1)])
    a.set_xlabel("added latency per request (ms)")
    a.set_ylabel("fraction of requests")
    a.set_title(f"gateway overhead, {result['endpoint']} (n={result['n']})")
    for q in ("p50_ms", "p99_ms"):
        a.axvline(result["added"][q], ls="--", color="gray")
        a.text(result["added"][q], 0.05, q[:3], rotation=90)
    names = ["direct", "http"]
    b.bar([f"{k} p50" for k in names] + [f"{k} p99" for k in names],
          [result[k]["p50_ms"] for k in names] + [result[k]["p99_ms"] for k in names], color="tab:blue")
    b.set_ylabel("ms")
    b.set_title(f"request latency, {result['max_tokens']} max tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="checkpoint directory (default: the bundled demo model, else a tiny random one)")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--endpoint", choices=["chat", "completions", "both"], default="both")
    ap.add_argument("--out", type=Path, default=Path("evals/out/gateway_overhead"))
    args = ap.parse_args()
    model = args.model
    demo = Path(__file__).resolve().parents[2] / "engine" / "assets" / "demo-moe"
    if model is None and (demo / "config.json").is_file():
        model = str(demo)
    if model is None:
        from modeltools.random_checkpoint import write_random_checkpoint

        model = str(write_random_checkpoint(Path(tempfile.mkdtemp()) / "tiny", "qwen3_moe", hidden_size=64,
                                            num_layers=2, num_experts=8, top_k=2, moe_intermediate_size=32,
                                            num_heads=4, num_kv_heads=2, vocab="bpe", seed=0))
    for endpoint in (["chat", "completions"] if args.endpoint == "both" else [args.endpoint]):
        r = run(model, args.n, args.max_tokens, endpoint, args.out)
        print(json.dumps({k: r[k] for k in ("endpoint", "direct", "http", "added")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
