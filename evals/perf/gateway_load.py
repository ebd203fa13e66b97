"""Closed-loop load against `moegate serve` in a process of its own, measured so that a reader sees the spread.

`served(...)` starts the gateway as a user would (`python -m gateway.cli serve`), so the client's Python never
shares the server's interpreter lock; `closed_loop` keeps `workers` requests in flight, each worker sending its
next request when its last one answered, and reports completion tokens over wall time and the server process's
CPU time per token (/proc: every thread of the server, not the client; and of its event loop, the main thread, and of
the engine thread inside its steps, from /metrics); `interleaved` runs several named loads
round after round (the order rotated each round, one warm-up round first) and summarises each figure and each
ratio of two loads as median, min and max over the rounds, every ratio taken within one round.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from evals.perf.common import free_port

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def served(model: str, state_dir: Path, timeout_s: float = 300.0) -> Iterator[tuple[str, int]]:
    """`moegate serve --model MODEL` (dev policy) in a child process -> (base url, pid); stopped on exit."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    log = open(state_dir / "serve.log", "w")  # noqa: SIM115 - closed below, after the child
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--model", model, "--port", str(port),
                             "--max-queue", "1024", "--state-dir", str(state_dir), "--log-level", "warning"],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"moegate serve exited with {proc.returncode}: see {state_dir / 'serve.log'}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"moegate serve did not answer /health within {timeout_s:.0f} s")
            time.sleep(0.2)
        yield url, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def process_cpu_s(pid: int, tid: int | None = None) -> float:
    """User + system CPU seconds of every thread of process `pid` so far (of its thread `tid` only, if given: the
    main thread's id is the process id)."""
    stat = Path(f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat")
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


def machine_busy_s() -> float:
    """CPU seconds all processes of the machine have run so far (/proc/stat: all but idle and iowait)."""
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    return (sum(vals) - vals[3] - vals[4]) / os.sysconf("SC_CLK_TCK")


STEP_COUNTER = re.compile(r'^moegate_engine_steps\{counter="(\w+)"\} (\S+)$', re.M)


async def engine_steps(client: httpx.AsyncClient) -> dict[str, float]:
    """The server's engine-step counters (/metrics: AsyncLLM.step_stats)."""
    r = await client.get("/metrics")
    r.raise_for_status()
    return {k: float(v) for k, v in STEP_COUNTER.findall(r.text)}


def per_step(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Engine steps between two scrapes: their count, mean wall and engine-thread CPU ms, sequences and tokens per
    step, and the engine loop's idle share of the interval."""
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    n = max(d.get("steps", 0.0), 1.0)
    busy = d.get("wall_seconds", 0.0) + d.get("idle_seconds", 0.0)
    return {"steps": d.get("steps", 0.0), "step_wall_ms": 1e3 * d.get("wall_seconds", 0.0) / n,
            "step_thread_cpu_ms": 1e3 * d.get("thread_cpu_seconds", 0.0) / n,
            "sequences_per_step": d.get("sequences", 0.0) / n, "tokens_per_step": d.get("tokens", 0.0) / n,
            "engine_idle_share": d.get("idle_seconds", 0.0) / busy if busy else 0.0}


@dataclass(frozen=True)
class Load:
    """`workers` clients each sending `per_worker` requests one after another; `body(worker, k)` is the JSON
    body of worker's k-th request."""

    workers: int
    per_worker: int
    body: Callable[[int, int], dict]


async def answered(client: httpx.AsyncClient, body: dict) -> int:
    """Completion tokens of one non-streamed chat request."""
    r = await client.post("/v1/chat/completions", json=body)
    r.raise_for_status()
    return r.json()["usage"]["completion_tokens"]


async def streamed(client: httpx.AsyncClient, body: dict) -> int:
    """Completion tokens of one streamed chat request (`stream_options.include_usage`: its usage chunk), every
    SSE event read and parsed as a client does."""
    usage = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"stream failed: {chunk['error']}")
                usage = chunk.get("usage") or usage
    if usage is None:
        raise RuntimeError("the stream ended without its usage chunk")
    return usage["completion_tokens"]


def closed_loop(url: str, pid: int, load: Load) -> dict[str, float]:
    """{tok_s, steady_tok_s, cpu_ms_per_token, loop_cpu_ms_per_token, engine_cpu_ms_per_token, tokens, wall_s,
    requests, others_cores, load_average, engine step figures (`per_step`)} of one run of `load`. loop_cpu_ms_per_token:
    the server's main thread (its event loop) per token; engine_cpu_ms_per_token: the engine thread inside its steps
    (the rest of cpu_ms_per_token: the kernels' pool threads, worker threads, the engine loop between steps). steady_tok_s: the engine's output tokens per second until the first
    stream has sent its last request and had it answered (before the batch drains: all streams busy); others_cores:
    the cores that processes other than the server and this client kept busy meanwhile (the load behind the figure);
    load_average: the machine's 1-minute load average when the run ended."""
    first_done: list[tuple[float, dict[str, float]]] = []

    async def worker(client: httpx.AsyncClient, w: int) -> int:
        tokens = 0
        for k in range(load.per_worker):
            body = load.body(w, k)
            tokens += await (streamed(client, body) if body.get("stream") else answered(client, body))
        if not first_done:
            first_done.append((0.0, {}))  # claimed: the other streams are still running
            counters = await engine_steps(client)
            first_done[0] = (time.perf_counter(), counters)
        return tokens

    async def run() -> dict[str, float]:
        limits = httpx.Limits(max_connections=load.workers, max_keepalive_connections=load.workers)
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": "Bearer bench"}, timeout=600,
                                     limits=limits) as client:
            steps = await engine_steps(client)
            t, cpu, mine, busy = time.perf_counter(), process_cpu_s(pid), time.process_time(), machine_busy_s()
            loop = process_cpu_s(pid, pid)
            tokens = sum(await asyncio.gather(*(worker(client, w) for w in range(load.workers))))
            wall, cpu = time.perf_counter() - t, process_cpu_s(pid) - cpu
            loop = process_cpu_s(pid, pid) - loop
            others = machine_busy_s() - busy - cpu - (time.process_time() - mine)
            (t_steady, at_steady), start = first_done[0], steps
            steps = per_step(steps, await engine_steps(client))
        steady = (at_steady["tokens"] - start["tokens"]) / (t_steady - t)
        engine = steps["step_thread_cpu_ms"] * steps["steps"] / 1e3
        return {"tok_s": tokens / wall, "steady_tok_s": steady, "cpu_ms_per_token": 1e3 * cpu / tokens,
                "loop_cpu_ms_per_token": 1e3 * loop / tokens, "engine_cpu_ms_per_token": 1e3 * engine / tokens,
                "tokens": tokens, "wall_s": wall, "requests": load.workers * load.per_worker,
                "others_cores": max(others, 0.0) / wall, "load_average": os.getloadavg()[0], **steps}

    return asyncio.run(run())


SUMMARISED = ("tok_s", "steady_tok_s", "cpu_ms_per_token", "loop_cpu_ms_per_token", "engine_cpu_ms_per_token",
              "others_cores", "load_average", "step_wall_ms",
              "step_thread_cpu_ms", "sequences_per_step", "tokens_per_step", "engine_idle_share")


def spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def interleaved(url: str, pid: int, loads: dict[str, Load], rounds: int,
                ratios: dict[str, tuple[str, str]], log: Callable[[str], None] = print) -> dict:
    """Each load once as a warm-up, then `rounds` rounds of all loads (order rotated per round).
    -> {"runs": {name: [per-round result]}, "summary": {name: {figure: spread}}, "ratios": {name: spread}} (each
    ratio of tok/s, and of steady_tok_s as "NAME (steady)")."""
    names = list(loads)
    for name in names:
        closed_loop(url, pid, loads[name])
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            res = closed_loop(url, pid, loads[name])
            runs[name].append(res)
            log(f"round {r + 1}/{rounds} {name}: {res['tok_s']:.1f} tok/s (steady {res['steady_tok_s']:.1f}), "
                f"{res['cpu_ms_per_token']:.2f} server CPU "
                f"ms/token (event loop {res['loop_cpu_ms_per_token']:.2f}, engine steps {res['engine_cpu_ms_per_token']:.2f}; "
                f"{res['tokens']} tokens, {res['wall_s']:.2f} s, other processes {res['others_cores']:.2f} "
                f"cores, load average {res['load_average']:.1f}); engine steps {res['step_wall_ms']:.2f} ms wall / "
                f"{res['step_thread_cpu_ms']:.2f} ms thread CPU, {res['sequences_per_step']:.2f} sequences and "
                f"{res['tokens_per_step']:.2f} tokens per step, idle {res['engine_idle_share']:.0%}")
    summary = {n: {k: spread([x[k] for x in runs[n]]) for k in SUMMARISED} for n in names}
    per_round = {f"{k}{label}": spread([runs[a][i][fig] / runs[b][i][fig] for i in range(rounds)])
                 for k, (a, b) in ratios.items() for label, fig in (("", "tok_s"), (" (steady)", "steady_tok_s"))}
    return {"runs": runs, "summary": summary, "ratios": per_round}
