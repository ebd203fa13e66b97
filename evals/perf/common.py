"""Shared helpers of the performance suites: machine facts and plots."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path


def cpu_busy_fraction(seconds: float = 1.0) -> float:
    """Fraction of all CPUs busy over `seconds` (from /proc/stat): load from other processes."""

    def snap() -> tuple[int, int]:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
        return sum(vals), vals[3] + vals[4]

    t0, i0 = snap()
    time.sleep(seconds)
    t1, i1 = snap()
    return 1.0 - (i1 - i0) / max(t1 - t0, 1)


def machine_info() -> dict:
    import torch

    from kernels.cpu_features import detect

    cpu = detect()
    return {
        "cpu": f"{cpu.model} {cpu.summary()}",
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "loadavg": os.getloadavg(),
        "cpu_busy_fraction": round(cpu_busy_fraction(0.5), 3),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def save_bar_plot(path: Path, title: str, groups: dict[str, dict[str, float]]) -> None:
    """One panel per group, one bar per series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4), squeeze=False)
    for ax, (name, series) in zip(axes[0], groups.items(), strict=True):
        ax.bar(range(len(series)), list(series.values()), color="tab:blue")
        ax.set_xticks(range(len(series)), list(series.keys()), rotation=30, ha="right", fontsize=8)
        ax.set_title(name)
        for i, v in enumerate(series.values()):
            ax.text(i, v, f"{v:.3g}", ha="center", va="bottom", fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def free_port() -> int:
    """A free TCP port on loopback."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_in_thread(settings, log_level: str = "warning", timeout_s: float = 120.0):
    """`create_app(settings)` under uvicorn in a daemon thread, started -> (server, thread, app, base url).
    Stop it with `server.should_exit = True; thread.join()`."""
    import threading

    import uvicorn

    from gateway.app import create_app

    app = create_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=settings.port, log_level=log_level))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the gateway did not start")
        time.sleep(0.05)
    return server, thread, app, f"http://127.0.0.1:{settings.port}"


def decode_rate(llm, prompts, tokens: int, mode: str) -> float:
    """Decode tok/s: time(prefill + tokens+1) - time(prefill + 1), best of 2."""
    from engine.sampling_params import SamplingParams

    engine = llm.engine

    def run(n: int) -> float:
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(max_tokens=n, ignore_eos=True), mode=mode)
        t = time.perf_counter()
        while engine.has_work():
            engine.step()
        return time.perf_counter() - t

    run(1)
    best = min(run(tokens + 1) - run(1) for _ in range(2))
    return len(prompts) * tokens / max(best, 1e-9)
