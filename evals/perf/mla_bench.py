"""Latent attention decode: the absorbed form (attend over the cached latents) against expanding K and V.

One DeepSeek-V2-Lite-shaped attention layer (16 heads, kv_lora_rank 512, rope 64, nope 128, v 128; the
V3 / Kimi-K2 latent is the same size with 128 heads) decodes one token over a context of C cached
latents, both ways, on the same random weights and cache, in the same run; reported as the expanded
form's time over the absorbed form's. Also the KV bytes per token the latent cache holds against
per-head K and V. Writes mla_bench.json and .png to --out.
Usage: PYTHONPATH=. python evals/perf/mla_bench.py [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.models.mla import LatentAttention
from evals.perf.common import machine_info, save_bar_plot

V2_LITE = {  # deepseek-ai/DeepSeek-V2-Lite config.json, attention numbers
    "model_type": "deepseek_v2", "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
    "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16,
    "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6, "kv_lora_rank": 512,
    "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "first_k_dense_replace": 1,
}


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return min(samples)  # the least disturbed run: other processes share the cores


def run(contexts: list[int], repeats: int) -> dict:
    cfg = ModelConfig.from_hf(V2_LITE)
    torch.set_num_threads(1)  # one thread: an OpenMP barrier waiting on a descheduled thread is not the op's cost
    torch.manual_seed(0)
    attn = LatentAttention(cfg).eval()
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    rows = {}
    with torch.inference_mode():
        for ctx in contexts:
            q = torch.randn(cfg.num_heads, 1, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)  # [NH, 1, N+P]
            lat = torch.randn(ctx, width)  # [ctx, R+P]
            expanded = _time(lambda q=q, lat=lat: attn._attend(q, *attn._expand(lat)), repeats)
            absorbed = _time(lambda q=q, lat=lat: attn._attend_absorbed(q, lat), repeats)
            err = (attn._attend(q, *attn._expand(lat)) - attn._attend_absorbed(q, lat)).abs().max().item()
            rows[ctx] = {"expanded_ms": expanded * 1e3, "absorbed_ms": absorbed * 1e3,
                         "expanded_over_absorbed": expanded / absorbed, "max_abs_diff": err}
    k_and_v = 2 * cfg.num_heads * max(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim)
    return {"machine": machine_info(), "model": "DeepSeek-V2-Lite attention (fp32, one layer, one decode token, 1 thread)",
            "contexts": rows, "kv_values_per_token_per_layer": {"latent": width, "expanded_k_and_v": k_and_v}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("evals/out/perf"))
    args = parser.parse_args()
    contexts, repeats = ([256, 1024], 5) if args.quick else ([256, 1024, 4096], 15)
    report = run(contexts, repeats)
    print(json.dumps(report["machine"]))
    for ctx, row in report["contexts"].items():
        print(f"context {ctx:5d}: expanded {row['expanded_ms']:.2f} ms, absorbed {row['absorbed_ms']:.2f} ms, "
              f"ratio {row['expanded_over_absorbed']:.1f}x, max |diff| {row['max_abs_diff']:.1e}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "mla_bench.json").write_text(json.dumps(report, indent=2))
    save_bar_plot(args.out / "mla_bench.png", "latent attention decode, one layer (ms, lower is better)",
                  {f"context {c}": {"expanded": r["expanded_ms"], "absorbed": r["absorbed_ms"]}
                   for c, r in report["contexts"].items()})


if __name__ == "__main__":
    main()
