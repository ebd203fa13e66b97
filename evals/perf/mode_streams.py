"""Execution at exploration speed: how execution streams scale with concurrency, with the default policy.

Three measurements, ratios taken within this one run (run through `python -m evals.perf.modes_bench --streams`):

1. engine API (the engine `moegate serve` builds from the policy, prefix cache off): tok/s of 1 and 8
   concurrent execution streams and of 1 and 8 exploration streams, for batched execution (execution
   chunks share one forward on the batch-invariant fused path) and, as the baseline, serial execution
   (`batch_invariant_execution=False`: each execution chunk in a forward of its own on torch);
2. gateway (`moegate serve` in a process of its own, dev policy, `evals/perf/gateway_load.py`): 1 and 8 concurrent
   json_schema streams (execution) and free-text streams (exploration), each stream a closed loop of `--requests`
   requests, tok/s from `usage.completion_tokens` over wall time and the server's CPU time per token (the work a
   token costs, steadier than tok/s on a shared machine), and the part of it on the event loop and on the engine
   thread inside its steps; one warm-up round, then `--rounds` interleaved rounds,
   each ratio taken within a round and reported as median, min and max over the rounds;
3. with `--bench-model DIR` (`moegate model init-random --preset bench`): decode tok/s of one execution
   and one exploration stream, the bytes one execution token streams and their rate against the STREAM
   triad of this machine.

Writes mode_streams.json and mode_streams.png to --out.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from evals.perf.common import machine_info, save_bar_plot
from evals.perf.gateway_load import Load, interleaved, served

ORDER_SCHEMA = {
    "type": "object",
    "properties": {"symbol": {"type": "string", "maxLength": 8}, "qty": {"type": "integer", "minimum": 1},
                   "side": {"type": "string", "enum": ["buy", "sell"]}, "account": {"type": "string", "maxLength": 12},
                   "note": {"type": "string", "maxLength": 80}},
    "required": ["symbol", "qty", "side", "account", "note"], "additionalProperties": False,
}
QUESTIONS = ["Buy 10 AAPL for account ACC-1.", "Sell 25 MSFT from account ACC-7.", "Buy 3 TSLA for ACC-2.",
             "Sell 100 NVDA from ACC-9.", "Buy 40 AMZN for account ACC-3.", "Sell 5 GOOG from ACC-4.",
             "Buy 12 META for account ACC-5.", "Sell 8 JPM from account ACC-6."]


def policy_llm(model: str, **overrides):
    """An LLM configured from the dev policy as `moegate serve` configures its engine (CPU)."""
    from engine.config import ModelConfig
    from engine.llm_engine import LLM
    from gateway.app import DEV_POLICY, numerics_from_policy
    from gateway.policy_reload import deferral_for
    from policies.loader import load_policy

    policy = load_policy(DEV_POLICY)
    n = numerics_from_policy(policy, deferral_for(policy, ModelConfig.from_dir(model).top_k, "cpu"))
    kw = dict(placement=n.experts, defer=n.defer, exact_lm_head=n.exact_lm_head, fast_lm_head=n.fast_lm_head,
              fast_dense=n.fast_dense, prefix_cache=False, progress=False, device="cpu")
    return LLM(model, **{**kw, **overrides})


def _prompts(llm, n: int) -> list[list[int]]:
    tok = llm.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]))
            for i in range(n)]


def engine_streams(llm, n: int, mode: str, tokens: int) -> float:
    """tok/s of n concurrent streams of `tokens` tokens each (prefill included), best of 2 after a warm-up."""
    from engine.sampling_params import SamplingParams

    engine, prompts = llm.engine, _prompts(llm, n)

    def run(max_tokens: int) -> float:
        for i, p in enumerate(prompts):
            engine.add_request(f"s{i}", p, SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=i), mode=mode)
        t = time.perf_counter()
        while engine.has_work():
            engine.step()
        return time.perf_counter() - t

    run(2)
    return n * tokens / min(run(tokens) for _ in range(2))


def engine_section(model: str, tokens: int) -> dict:
    out = {}
    for name, batched in (("batched", True), ("serial", False)):
        llm = policy_llm(model, batch_invariant_execution=batched)
        modes = ("execution", "exploration") if batched else ("execution",)
        for mode in modes:
            for n in (1, 8):
                out[f"{name} {mode} x{n}"] = engine_streams(llm, n, mode, tokens)
                print(f"engine {name} {mode} x{n}: {out[f'{name} {mode} x{n}']:.1f} tok/s", flush=True)
        llm.engine.runner.shutdown()
    return out


def _chat_body(structured: bool, max_tokens: int, stream: bool = False) -> Callable[[int, int], dict]:
    def body(worker: int, k: int) -> dict:
        # a JSON answer ends when its object closes: its budget stays loose (a tight one makes the constraint
        # plan the shortest way to close at each step, which is not what this measures)
        b = {"model": "moegate-demo", "max_tokens": 8 * max_tokens if structured else max_tokens,
             "messages": [{"role": "user", "content": QUESTIONS[(worker + k) % len(QUESTIONS)]}]}
        if structured:
            b["response_format"] = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER_SCHEMA}}
        if stream:
            b.update(stream=True, stream_options={"include_usage": True})
        return b

    return body


GATEWAY_RATIOS = {"json_schema x8 / x1": ("json_schema x8", "json_schema x1"),
                  "json_schema x8 / free text x8": ("json_schema x8", "free text x8"),
                  "free text x8 / x1": ("free text x8", "free text x1")}


def gateway_section(model: str, max_tokens: int, rounds: int, requests: int, stream: bool = False) -> dict:
    """`moegate serve` in a process of its own, dev policy: 1 and 8 concurrent json_schema (execution) and free-text
    (exploration) streams, closed loop, `requests` requests per stream (x1: 8 x `requests`, the questions the 8
    streams ask), interleaved over `rounds` rounds; tok/s and server CPU ms per token as median, min and max.
    `stream`: every request streamed (SSE, with its usage chunk), the client reading each event."""
    loads = {f"{name} x{n}": Load(n, requests * (8 // n), _chat_body(structured, max_tokens, stream))
             for name, structured in (("json_schema", True), ("free text", False)) for n in (1, 8)}
    with tempfile.TemporaryDirectory() as tmp, served(model, Path(tmp)) as (url, pid):
        return interleaved(url, pid, loads, rounds, GATEWAY_RATIOS, log=lambda line: print(f"gateway {line}",
                                                                                          flush=True))


def execution_bytes_per_token(model) -> int:
    """Weight bytes one execution decode token streams on the fused path: packed attention projections,
    router, top-k exact experts per MoE layer and the packed lm_head."""
    total = model.exact_head.nbytes
    for layer in model.model.layers:
        attn = layer.self_attn
        total += attn.exact_qkv.nbytes + attn.exact_o.nbytes + layer.mlp.gate.weight.numel() * 4
        shard = layer.mlp.experts.packed.exact[0].packed
        total += model.config.top_k * shard.expert_nbytes()
    return total


def single_stream_section(model: str, tokens: int) -> dict:
    """Decode tok/s of one stream per mode (and of serial execution, the baseline), bytes vs the triad."""

    from evals.perf.common import decode_rate
    from evals.perf.kernel_bench import stream_triad

    serial = policy_llm(model, batch_invariant_execution=False)
    prompts = _prompts(serial, 1)
    out = {"serial_execution_tok_s": decode_rate(serial, prompts, tokens, "execution")}
    serial.engine.runner.shutdown()
    del serial
    llm = policy_llm(model)
    out["execution_tok_s"] = decode_rate(llm, prompts, tokens, "execution")
    out["exploration_tok_s"] = decode_rate(llm, prompts, tokens, "exploration")
    model_ = llm.engine.runner.model
    if model_.batch_invariant(True):
        out["execution_bytes_per_token"] = execution_bytes_per_token(model_)
        out["execution_gb_s"] = out["execution_bytes_per_token"] * out["execution_tok_s"] / 1e9
    threads = llm.engine.runner.max_threads  # the kernel pool's; torch's may be left at 1 by a small forward
    llm.engine.runner.shutdown()
    out["triad"] = stream_triad(threads)
    triad = max(v for k, v in out["triad"].items() if k.startswith("triad"))
    out["execution_vs_exploration"] = out["execution_tok_s"] / out["exploration_tok_s"]
    out["execution_vs_serial"] = out["execution_tok_s"] / out["serial_execution_tok_s"]
    if "execution_gb_s" in out:
        out["execution_share_of_triad"] = out["execution_gb_s"] / triad
    print(json.dumps(out), flush=True)
    return out


def save_plot(res: dict, path: Path) -> None:
    groups = {k: res[k] for k in ("engine", "gateway") if k in res}
    groups.update({k: res[k] for k in ("engine_ratios", "gateway_cpu_ms_per_token", "gateway_cpu_split_ms_per_token")
                   if k in res})
    if "gateway_ratio_spread" in res:  # each ratio's median, min and max over the interleaved rounds
        groups["gateway ratios (median / min / max of rounds)"] = {
            f"{k} {stat}": v[stat] for k, v in res["gateway_ratio_spread"].items() for stat in ("median", "min", "max")}
        # why a figure moves: the engine thread off its core (step wall vs its CPU) and the other processes' cores
        groups["gateway engine step ms, wall / thread CPU (median)"] = {
            f"{n} {label}": v[key]["median"] for n, v in res["gateway_spread"].items()
            for label, key in (("wall", "step_wall_ms"), ("CPU", "step_thread_cpu_ms"))}
        groups["other processes, cores (median)"] = {n: v["others_cores"]["median"]
                                                     for n, v in res["gateway_spread"].items()}
    if "single_stream" in res:
        s = res["single_stream"]
        groups["one stream, bench checkpoint"] = {k: s[k] for k in ("serial_execution_tok_s", "execution_tok_s",
                                                                     "exploration_tok_s")}
    save_bar_plot(path, f"execution streams (tok/s, ratios), {res['machine']['cpu_count']} CPUs", groups)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="checkpoint of the engine and gateway sections (demo model)")
    ap.add_argument("--out", default="evals/out/modes")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    ap.add_argument("--bench-model", help="checkpoint of the single-stream section (`--preset bench`)")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: engine, gateway")
    ap.add_argument("--rounds", type=int, default=9, help="gateway: interleaved rounds (median, min, max)")
    ap.add_argument("--requests", type=int, default=2, help="gateway: requests per stream per round")
    ap.add_argument("--stream", action="store_true", help="gateway: stream every request (SSE) instead of one body")
    args = ap.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    res: dict = {"model": args.model, "tokens": args.tokens, "machine": machine_info()}
    if "engine" not in skip:
        e = res["engine"] = engine_section(args.model, args.tokens)
        res["engine_ratios"] = {
            "batched exec x8 / exec x1": e["batched execution x8"] / e["batched execution x1"],
            "batched exec x8 / exploration x8": e["batched execution x8"] / e["batched exploration x8"],
            "serial exec x8 / exec x1": e["serial execution x8"] / e["serial execution x1"],
            "batched / serial exec x8": e["batched execution x8"] / e["serial execution x8"],
        }
    if "gateway" not in skip:
        g = gateway_section(args.model, args.tokens, args.rounds, args.requests, args.stream)
        res["gateway_stream"] = args.stream
        res["gateway_runs"] = g["runs"]
        res["gateway"] = {k: v["tok_s"]["median"] for k, v in g["summary"].items()}
        res["gateway_cpu_ms_per_token"] = {k: v["cpu_ms_per_token"]["median"] for k, v in g["summary"].items()}
        # of which the event loop (the server's main thread) and the engine thread inside its steps
        res["gateway_cpu_split_ms_per_token"] = {f"{k} {part}": v[f"{part}_cpu_ms_per_token"]["median"]
                                                 for k, v in g["summary"].items() for part in ("loop", "engine")}
        res["gateway_spread"] = g["summary"]
        res["gateway_ratios"] = {k: v["median"] for k, v in g["ratios"].items()}
        res["gateway_ratio_spread"] = g["ratios"]
    if args.bench_model:
        res["single_stream"] = single_stream_section(args.bench_model, min(args.tokens, 32))
    (out_dir / "mode_streams.json").write_text(json.dumps(res, indent=2))
    save_plot(res, out_dir / "mode_streams.png")
    print(json.dumps({k: res[k] for k in res if k.endswith("ratios")}, indent=2))
    return res


if __name__ == "__main__":
    main()
