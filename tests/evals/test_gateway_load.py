"""The gateway load driver against a real `moegate serve` process: tokens, server CPU and engine-step counters of a
closed loop, and every ratio taken within a round."""

from __future__ import annotations

import pytest

from evals.perf.gateway_load import Load, interleaved, per_step, served


def _body(worker: int, k: int) -> dict:
    return {"model": "moegate-demo", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": f"stream {worker} request {k}"}]}


def test_closed_loops_report_tokens_cpu_and_engine_steps(tiny_checkpoint, tmp_path):
    loads = {"x1": Load(1, 2, _body), "x2": Load(2, 1, _body)}
    with served(str(tiny_checkpoint()), tmp_path) as (url, pid):
        res = interleaved(url, pid, loads, rounds=2, ratios={"x2 / x1": ("x2", "x1")}, log=lambda _: None)
    for name, runs in res["runs"].items():
        assert len(runs) == 2, name
        for r in runs:
            assert r["requests"] == 2 and r["tokens"] > 0 and r["tok_s"] > 0 and r["steady_tok_s"] > 0
            assert r["cpu_ms_per_token"] > 0 and r["others_cores"] >= 0 and r["load_average"] >= 0
            assert r["steps"] >= r["tokens"] / 2 and r["tokens_per_step"] > 0  # engine counters seen over /metrics
            # the event loop's and the engine thread's parts of the server's CPU (clock ticks: the loop may read 0)
            assert 0 <= r["loop_cpu_ms_per_token"] and 0 < r["engine_cpu_ms_per_token"]
            assert r["loop_cpu_ms_per_token"] + r["engine_cpu_ms_per_token"] <= r["cpu_ms_per_token"] + 20 / r["tokens"]  # two ticks
    for key in ("x2 / x1", "x2 / x1 (steady)"):
        s = res["ratios"][key]
        assert s["min"] <= s["median"] <= s["max"]
    x1, x2 = res["runs"]["x1"], res["runs"]["x2"]
    assert res["ratios"]["x2 / x1"]["max"] == max(a["tok_s"] / b["tok_s"] for a, b in zip(x2, x1, strict=True))


def test_per_step_divides_the_counter_deltas():
    before = {"steps": 10, "sequences": 10, "tokens": 12, "wall_seconds": 1.0, "thread_cpu_seconds": 0.5,
              "idle_seconds": 2.0}
    after = {"steps": 20, "sequences": 50, "tokens": 72, "wall_seconds": 1.5, "thread_cpu_seconds": 0.7,
             "idle_seconds": 2.5}
    assert per_step(before, after) == pytest.approx({
        "steps": 10, "step_wall_ms": 50.0, "step_thread_cpu_ms": 20.0, "sequences_per_step": 4.0,
        "tokens_per_step": 6.0, "engine_idle_share": 0.5})


def test_a_streamed_load_counts_the_tokens_of_its_usage_chunks(tiny_checkpoint, tmp_path):
    streamed = lambda w, k: {**_body(w, k), "stream": True, "stream_options": {"include_usage": True}}  # noqa: E731
    loads = {"body": Load(2, 1, _body), "stream": Load(2, 1, streamed)}
    with served(str(tiny_checkpoint()), tmp_path) as (url, pid):
        res = interleaved(url, pid, loads, rounds=1, ratios={}, log=lambda _: None)
    body, stream = res["runs"]["body"][0], res["runs"]["stream"][0]
    assert stream["requests"] == 2 and stream["tokens"] == body["tokens"] > 0  # greedy: the same answers
