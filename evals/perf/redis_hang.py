"""Throughput while redis hangs: the gateway with a real redis-server as its limit store (fail_open policy with
rate, concurrency and token limits), under `--clients` concurrent chat requests, in three phases of
`--seconds` each: redis healthy; redis paused with SIGSTOP (accepts connections, answers nothing) with the
circuit breaker; the same pause with the breaker disabled (the baseline: every call waits its socket
timeout). Writes redis_hang.json and .png to --out.

    python -m evals.perf.redis_hang --seconds 15 --clients 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
from tqdm.auto import tqdm

from evals.perf.common import free_port, machine_info, save_bar_plot, serve_in_thread
from evals.perf.gateway_overhead import _percentile

DEV = Path(__file__).resolve().parents[2] / "policies" / "examples" / "dev.yaml"
LIMITS = """limits:
  requests_per_min: 1000000
  request_burst: 100000
  tokens_per_min: 100000000
  concurrency: 1000
  max_tokens: 64
  tokens_per_day: 1000000000
"""


def _start_redis(workdir: Path) -> tuple[subprocess.Popen, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("redis-server not found: install it to run this benchmark")
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir),
                             "--save", "", "--appendonly", "no", "--loglevel", "warning"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(200):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start")


def _policy(tmp: Path) -> Path:
    text = DEV.read_text()
    start, end = text.index("limits:"), text.index("audit:")
    path = tmp / "policy.yaml"
    path.write_text(text[:start] + LIMITS + "\n" + text[end:])
    return path


async def _load(url: str, model: str, clients: int, seconds: float, label: str) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": "Quote AAPL."}], "max_tokens": 1}
    latencies: list[float] = []
    errors: dict[str, int] = {}
    deadline = time.perf_counter() + seconds
    bar = tqdm(total=int(seconds), desc=label, unit="s")

    async def client(http: httpx.AsyncClient) -> None:
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            r = await http.post("/v1/chat/completions", json=body)
            if r.status_code == 200:
                latencies.append(time.perf_counter() - t0)
            else:
                errors[str(r.status_code)] = errors.get(str(r.status_code), 0) + 1

    async def tick() -> None:
        while time.perf_counter() < deadline:
            await asyncio.sleep(1)
            bar.update(1)

    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": "Bearer sk-dev-local"},
                                 timeout=120) as http:
        await asyncio.gather(tick(), *(client(http) for _ in range(clients)))
    elapsed = time.perf_counter() - start
    bar.close()
    ms = [x * 1000 for x in latencies]
    return {"requests": len(latencies), "errors": errors, "seconds": round(elapsed, 2),
            "req_per_s": round(len(latencies) / elapsed, 2),
            "p50_ms": round(_percentile(ms, 0.5), 1) if ms else None,
            "p99_ms": round(_percentile(ms, 0.99), 1) if ms else None}


def run(model: str, clients: int, seconds: float, out: Path) -> dict:


    from engine.circuit_breaker import CircuitBreaker
    from gateway.settings import Settings

    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        redis, redis_url = _start_redis(tmp)
        port = free_port()
        settings = Settings(model=model, model_name="moegate-demo", policy_path=str(_policy(tmp)), port=port,
                            state_dir=tmp / "state", kv_cache_gib=0.1, max_queue=1024, redis_url=redis_url)
        server, thread, app, url = serve_in_thread(settings, log_level="error")
        store = app.state.moegate.store
        phases: dict[str, dict] = {}
        try:
            asyncio.run(_load(url, "moegate-demo", clients, 2, "warm-up"))
            phases["healthy"] = asyncio.run(_load(url, "moegate-demo", clients, seconds, "redis healthy"))
            os.kill(redis.pid, signal.SIGSTOP)
            phases["hung, breaker"] = asyncio.run(_load(url, "moegate-demo", clients, seconds, "hung, breaker"))
            phases["hung, breaker"]["breaker_opened"] = store.breaker.opened
            phases["hung, breaker"]["calls_skipped"] = store.breaker.skipped
            store.breaker = CircuitBreaker(threshold=10**9)  # baseline: never opens
            phases["hung, no breaker"] = asyncio.run(_load(url, "moegate-demo", clients, seconds,
                                                           "hung, no breaker"))
        finally:
            os.kill(redis.pid, signal.SIGCONT)
            server.should_exit = True
            thread.join(30)
            redis.kill()
            redis.wait(10)
    result = {"model": model, "clients": clients, "seconds_per_phase": seconds, "max_tokens": 1,
              "store_timeout_s": 0.5, "phases": phases, "machine": machine_info()}
    (out / "redis_hang.json").write_text(json.dumps(result, indent=2))
    save_bar_plot(out / "redis_hang.png", f"gateway with a hung redis (fail_open, {clients} clients)",
                  {"requests / s": {k: v["req_per_s"] for k, v in phases.items()},
                   "p50 latency (ms)": {k: v["p50_ms"] or 0.0 for k, v in phases.items()}})
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="checkpoint directory (default: the bundled demo model)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--out", type=Path, default=Path("evals/out/redis_hang"))
    args = ap.parse_args()
    model = args.model or str(Path(__file__).resolve().parents[2] / "engine" / "assets" / "demo-moe")
    r = run(model, args.clients, args.seconds, args.out)
    print(json.dumps(r["phases"], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
