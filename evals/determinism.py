"""Execution-mode determinism through the gateway, as an agent sees it.

One json_schema request (temperature 0.7, a fixed seed) is sent `--repeats` times alone and `--repeats`
times beside `--companions` concurrent free-text (exploration) requests, for a short prompt and a long
one (~700 tokens); each setting must give exactly one distinct output. The first request of each prompt
is a prefix-cache miss and the later ones hits (`usage.prompt_tokens_details.cached_tokens`): the hit
must give the miss's bytes. `moegate serve` runs in a thread with the default (dev) policy.

    python -m evals.determinism [--model DIR] [--repeats 20] [--companions 8]

Writes determinism.json and determinism.png to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

from engine.assets import DEMO_MODEL_DIR as DEMO
from evals.perf.common import free_port, machine_info, save_bar_plot, serve_in_thread
from evals.perf.mode_streams import ORDER_SCHEMA as ORDER


def prompts(long_tokens: int = 700) -> dict[str, str]:
    """A short order and one that carries a ledger of about `long_tokens` tokens before it."""
    ledger = " ".join(f"{i}: AAPL {100 + i % 37}.{i % 10} x{1 + i % 9}" for i in range(long_tokens // 18))  # ~18 tokens each
    return {"short": "Buy 10 AAPL for account ACC-1.",
            "long": f"Ledger of today's fills: {ledger}. Given the ledger, buy 10 AAPL for account ACC-1."}


async def _setting(client, text: str, repeats: int, companions: int, seed: int) -> list[dict]:
    body = {"model": "moegate-demo", "messages": [{"role": "user", "content": text}], "max_tokens": 160,
            "temperature": 0.7, "seed": seed,
            "response_format": {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER}}}
    side = {"model": "moegate-demo", "max_tokens": 48, "temperature": 0.9}
    out = []
    for rep in range(repeats):
        others = [client.post("/v1/chat/completions", json={
            **side, "seed": rep * 100 + i, "messages": [{"role": "user", "content": f"Market note {rep}.{i}: "}]})
            for i in range(companions)]
        first, *rest = await asyncio.gather(client.post("/v1/chat/completions", json=body), *others)
        for r in (first, *rest):
            r.raise_for_status()
        data = first.json()
        out.append({"content": data["choices"][0]["message"]["content"],
                    "cached_tokens": data["usage"]["prompt_tokens_details"]["cached_tokens"],
                    "prompt_tokens": data["usage"]["prompt_tokens"]})
    return out


async def _measure(url: str, repeats: int, companions: int, seed: int) -> dict:
    import httpx

    results = {}
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": "Bearer eval"}, timeout=900) as client:
        for name, text in prompts().items():
            alone = await _setting(client, text, repeats, 0, seed)
            beside = await _setting(client, text, repeats, companions, seed)
            runs = alone + beside
            results[name] = {
                "prompt_tokens": runs[0]["prompt_tokens"],
                "distinct_alone": len({r["content"] for r in alone}),
                "distinct_beside": len({r["content"] for r in beside}),
                "distinct_all": len({r["content"] for r in runs}),
                "miss_cached_tokens": runs[0]["cached_tokens"],
                "hit_cached_tokens_min": min(r["cached_tokens"] for r in runs[1:]) if len(runs) > 1 else None,
                "hit_equals_miss": all(r["content"] == runs[0]["content"] for r in runs[1:]),
                "outputs": sorted({r["content"] for r in runs})[:3],
            }
            print(name, {k: v for k, v in results[name].items() if k != "outputs"}, flush=True)
    return results


def run(model: str, repeats: int, companions: int, seed: int = 1234, out: Path | None = None) -> dict:
    from gateway.settings import Settings

    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(model=model, port=free_port(), state_dir=Path(tmp), kv_cache_gib=0.25, max_queue=1024)
        server, thread, _app, url = serve_in_thread(settings)
        try:
            results = asyncio.run(_measure(url, repeats, companions, seed))
        finally:
            server.should_exit = True
            thread.join(30)
    report = {"machine": machine_info(), "model": model, "repeats": repeats, "companions": companions,
              "seed": seed, "temperature": 0.7, "prompts": results}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "determinism.json").write_text(json.dumps(report, indent=2))
        groups = {f"{p} prompt ({v['prompt_tokens']} tokens)": {
            "alone": v["distinct_alone"], f"beside {companions}": v["distinct_beside"], "all": v["distinct_all"]}
            for p, v in results.items()}
        save_bar_plot(out / "determinism.png", f"distinct json_schema outputs at temperature 0.7, seed {seed}, "
                      f"{repeats} repeats per setting (1 = deterministic)", groups)
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(DEMO))
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--companions", type=int, default=8)
    p.add_argument("--out", type=Path, default=Path("evals/results"))
    args = p.parse_args(argv)
    report = run(args.model, args.repeats, args.companions, out=args.out)
    ok = all(v["distinct_all"] == 1 and v["hit_equals_miss"] for v in report["prompts"].values())
    print("deterministic" if ok else "NOT deterministic")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
