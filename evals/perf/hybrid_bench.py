"""The hybrid engine on one machine: dense part on the fast device, routed experts in host memory.

Four measurements, each against its baseline in the same run:
1. decode tok/s of 8 exploration streams at expert deferral d = 0 (strict), 1, 2 (ratio vs d=0);
2. prefill of a long prompt (default 4,096 tokens) with and without layer-wise prefill (ratio);
3. fast-device memory: peak allocated vs the dense part's bytes (routed experts must not be there);
4. hot-set hit rate: share of routed activations served by the faster tier, static uniform vs dynamic.

Meant for a CUDA machine (`--device cuda`, the default when CUDA is present); on a CPU-only machine it
runs the same code with the CPU as the fast device (a smoke run: the ratios there say nothing about a
GPU). Writes hybrid_bench.json and hybrid_bench.png.
Usage: python -m evals.perf.hybrid_bench --model DIR [--device cuda] [--prompt-tokens 4096] [--quick]
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


def _llm(args, **kw):
    from engine.experts import PlacementConfig
    from engine.llm_engine import LLM

    placement = kw.pop("placement", None) or PlacementConfig(fast_format=args.format, exact_format="bf16")
    return LLM(args.model, device=args.device, dtype=args.dtype, placement=placement, prefix_cache=False,
               progress=False, max_num_batched_tokens=args.chunk, kv_cache_gib=args.kv_gib, **kw)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _decode(args, defer: int) -> float:
    from engine.sampling_params import SamplingParams

    llm = _llm(args, defer=defer, layerwise_prefill_tokens=None)
    engine = llm.engine
    g = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size

    def run() -> float:
        """Seconds of the decode steps alone: timed from the step after every stream has its first token."""
        for i in range(8):
            engine.add_request(f"d{i}", torch.randint(10, vocab - 10, (32,), generator=g).tolist(),
                               SamplingParams(max_tokens=args.tokens + 1, ignore_eos=True))
        started: set[str] = set()
        while len(started) < 8:
            started |= {o.request_id for o in engine.step() if o.token_ids}
        _sync(args.device)
        t = time.perf_counter()
        while engine.has_work():
            engine.step()
        _sync(args.device)
        return time.perf_counter() - t

    run()  # warm-up
    best = min(run() for _ in range(2))
    return 8 * args.tokens / best


def _prefill(args, layerwise: int | None) -> dict:
    from engine.sampling_params import SamplingParams

    llm = _llm(args, layerwise_prefill_tokens=layerwise)
    engine = llm.engine
    prompt = torch.randint(10, engine.model_config.vocab_size - 10, (args.prompt_tokens,),
                           generator=torch.Generator().manual_seed(1)).tolist()
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    _sync(args.device)
    t = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1))
    _sync(args.device)
    seconds = time.perf_counter() - t
    dense = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters()
                if p.device.type == args.device)
    peak = torch.cuda.max_memory_allocated() if args.device == "cuda" else None
    lw = engine.runner.experts.layerwise
    return {"tok_per_s": args.prompt_tokens / seconds, "seconds": seconds, "dense_bytes": dense,
            "peak_device_bytes": peak, "bursts_on_device": lw.bursts if lw is not None else 0}


def _hit_rate(args, dynamic: bool) -> float:
    from engine.experts import DynamicHotConfig, PlacementConfig
    from engine.sampling_params import SamplingParams
    from evals.perf.hot_set_bench import step_counting_hits

    share = dict(hot_experts=args.hot) if args.device == "cuda" else dict(mixed_hot_fraction=0.25)
    placement = PlacementConfig(fast_format=args.format, exact_format="bf16", execution_format=args.format,
                                hot_strategy="dynamic", dynamic=DynamicHotConfig(
                                    interval_steps=8 if dynamic else 10**9, threshold=0.005, max_swaps=8), **share)
    llm = _llm(args, placement=placement, layerwise_prefill_tokens=None)
    engine = llm.engine
    g = torch.Generator().manual_seed(2)
    routed = served = 0
    for wave in range(args.waves):
        for i in range(8):
            vocab = engine.model_config.vocab_size
            engine.add_request(f"h{wave}_{i}", torch.randint(10, min(2000, vocab - 10), (48,), generator=g).tolist(),
                               SamplingParams(max_tokens=args.tokens, temperature=0.8, seed=i, ignore_eos=True))
        while engine.has_work():
            _, r, s = step_counting_hits(engine)
            routed, served = routed + r, served + s
    return served / routed if routed else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEMO))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--format", default="int4", help="routed-expert format in host memory")
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk (max_num_batched_tokens)")
    ap.add_argument("--kv-gib", type=float, default=2.0)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--hot", type=int, default=4, help="GPU hot experts per layer (CUDA)")
    ap.add_argument("--waves", type=int, default=4)
    ap.add_argument("--out", default="evals/out/perf")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    if args.quick:
        args.prompt_tokens, args.chunk, args.tokens, args.waves = 256, 128, 8, 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from engine.config import ModelConfig

    depths = list(range(0, min(2, ModelConfig.from_dir(args.model).top_k // 2) + 1))
    bar = tqdm(total=len(depths) + 4, desc=f"hybrid bench ({args.device})", unit="run")
    decode = {}
    for d in depths:
        decode[f"d={d}"] = _decode(args, d)
        bar.update()
    prefill = {}
    for name, lw in (("CPU experts", None), ("layer-wise", max(1, args.chunk // 4))):
        prefill[name] = _prefill(args, lw)
        bar.update()
    hits = {}
    for name, dyn in (("static uniform", False), ("dynamic", True)):
        hits[name] = _hit_rate(args, dyn)
        bar.update()
    bar.close()
    base = decode["d=0"]
    result = {
        "machine": machine_info(), "model": args.model, "device": args.device, "dtype": args.dtype,
        "expert_format": args.format, "prompt_tokens": args.prompt_tokens,
        "decode_tok_per_s": decode, "decode_vs_strict": {k: v / base for k, v in decode.items()},
        "prefill": prefill,
        "prefill_layerwise_vs_cpu": prefill["layer-wise"]["tok_per_s"] / prefill["CPU experts"]["tok_per_s"],
        "hot_set_hit_rate": hits,
    }
    (out / "hybrid_bench.json").write_text(json.dumps(result, indent=2))
    save_bar_plot(out / "hybrid_bench.png", f"hybrid engine on {args.device} ({args.format} experts)", {
        "decode vs strict": result["decode_vs_strict"],
        "prefill tok/s": {k: v["tok_per_s"] for k, v in prefill.items()},
        "hot-set hit rate": hits})
    print(json.dumps({k: result[k] for k in ("decode_vs_strict", "prefill_layerwise_vs_cpu", "hot_set_hit_rate")},
                     indent=1))
    for name, p in prefill.items():
        if p["peak_device_bytes"] is not None:
            print(f"{name}: peak {args.device} memory {p['peak_device_bytes'] / 2**30:.2f} GiB, "
                  f"dense part {p['dense_bytes'] / 2**30:.2f} GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
