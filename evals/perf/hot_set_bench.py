"""Hot-set hit rate: the share of routed expert activations served by the faster tier, for a static
uniform hot set (experts 0..n-1), a static frequency hot set computed from a calibration run on other
prompts, and the dynamic hot set that follows the traffic (engine/hot_experts.py), on the same traffic.

On a CPU-only machine the faster tier is the exact format in host memory (`mixed_hot_fraction`); on a GPU
it is the experts resident there (`hot_experts`): the mechanism and the figure are the same. Also reports
exploration decode tok/s per configuration (more bf16 traffic costs bytes). Writes hot_set_bench.json and
hot_set_bench.png. Usage: python -m evals.perf.hot_set_bench [--model DIR] [--share 0.25] [--quick]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from evals.perf.common import machine_info, save_bar_plot

DEMO = Path(__file__).resolve().parents[2] / "engine" / "assets" / "demo-moe"
CALIBRATION = ["What moves the 10-year yield this week?", "Summarise the risk on a long AAPL position.",
               "Should we hedge EUR exposure before the ECB meeting?", "Explain the bid-ask spread on TSLA."]
TRAFFIC = ["How does duration affect a bond portfolio?", "What is the VaR of a 60/40 portfolio?",
           "Compare the liquidity of MSFT and NVDA options.", "Why did the yen weaken against the dollar?",
           "Draft a note on credit spreads for the risk committee.", "Is gold a hedge against inflation?"]


def _llm(model: str, share: float, strategy: str, stats: str | None, interval: int):
    from engine.experts import DynamicHotConfig, PlacementConfig
    from engine.llm_engine import LLM

    placement = PlacementConfig(fast_format="int4", exact_format="bf16", execution_format="bf16",
                                mixed_hot_fraction=share, hot_strategy=strategy, stats_file=stats,
                                dynamic=DynamicHotConfig(interval_steps=interval, threshold=0.005, max_swaps=8))
    return LLM(model, placement=placement, num_kv_blocks=512, prefix_cache=False, progress=False)


def _prompts(llm, questions: list[str]) -> list[list[int]]:
    tok = llm.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in questions]


def step_counting_hits(engine) -> tuple[list, int, int]:
    """One engine step -> (its outputs, routed activations, of them served by the faster tier as it stood)."""
    before = {i: le.counts.clone() for i, le in engine.layer_experts.items()}
    upper = {i: list(le.fast[0].packed.expert_ids) for i, le in engine.layer_experts.items()}
    outputs = engine.step()
    routed = served = 0
    for i, le in engine.layer_experts.items():
        delta = le.counts - before[i]
        routed += int(delta.sum())
        served += int(delta[upper[i]].sum())
    return outputs, routed, served


def _serve(llm, prompts: list[list[int]], tokens: int, waves: int) -> dict[str, float]:
    """Runs `waves` rounds of the prompts as concurrent exploration streams; hit rate from routed counts."""
    from engine.sampling_params import SamplingParams

    engine = llm.engine
    routed = served = generated = 0
    t0 = time.perf_counter()
    for w in range(waves):
        for k, p in enumerate(prompts):
            engine.add_request(f"w{w}_{k}", p, SamplingParams(max_tokens=tokens, temperature=0.8, seed=w * 100 + k,
                                                              ignore_eos=True), mode="exploration")
        while engine.has_work():
            outputs, r, s = step_counting_hits(engine)
            generated += sum(1 for o in outputs if o.new_token_ids)
            routed, served = routed + r, served + s
    seconds = time.perf_counter() - t0
    return {"hit_rate": served / routed if routed else 0.0, "tok_per_s": generated / seconds,
            "swaps": engine.hot_set.stats()["swaps"] if engine.hot_set is not None else 0}


def main(argv: list[str] | None = None) -> int:
    from engine.experts import save_routing_stats

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEMO))
    ap.add_argument("--share", type=float, default=0.25, help="share of each layer's experts in the faster tier")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--waves", type=int, default=4)
    ap.add_argument("--interval", type=int, default=8, help="dynamic: engine steps between looks")
    ap.add_argument("--out", default="evals/out/perf")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    if args.quick:
        args.tokens, args.waves = 16, 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)

    calib = _llm(args.model, args.share, "dynamic", None, 10**9)  # never swaps: counts only
    _serve(calib, _prompts(calib, CALIBRATION), args.tokens, 1)
    stats = out / "hot_set_calibration.json"
    save_routing_stats(stats, calib.engine.layer_experts)
    configs = {"static uniform": ("dynamic", None, 10**9), "static frequency (calibrated)": ("frequency", str(stats), 1),
               "dynamic (from uniform)": ("dynamic", None, args.interval)}
    rows = {}
    for name, (strategy, stats_file, interval) in tqdm(configs.items(), desc="hot set bench", unit="config"):
        llm = _llm(args.model, args.share, strategy, stats_file, interval)
        rows[name] = _serve(llm, _prompts(llm, TRAFFIC), args.tokens, args.waves)
        llm.engine.close()
    base = rows["static uniform"]
    for r in rows.values():
        r["hit_rate_vs_uniform"] = r["hit_rate"] / base["hit_rate"] if base["hit_rate"] else 0.0
        r["tok_per_s_vs_uniform"] = r["tok_per_s"] / base["tok_per_s"]
    result = {"machine": machine_info(), "model": args.model, "share": args.share, "tokens": args.tokens,
              "waves": args.waves, "interval_steps": args.interval, "rows": rows}
    (out / "hot_set_bench.json").write_text(json.dumps(result, indent=2))
    save_bar_plot(out / "hot_set_bench.png", f"hot-set hit rate ({args.share:.0%} of experts in the faster tier)",
                  {"hit rate": {k: v["hit_rate"] for k, v in rows.items()},
                   "tok/s vs uniform": {k: v["tok_per_s_vs_uniform"] for k, v in rows.items()}})
    for name, r in rows.items():
        print(f"{name:32s} hit rate {r['hit_rate']:.3f} ({r['hit_rate_vs_uniform']:.2f}x uniform)  "
              f"{r['tok_per_s']:.1f} tok/s ({r['tok_per_s_vs_uniform']:.2f}x)  swaps {r['swaps']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
