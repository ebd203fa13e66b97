"""End-to-end prefill and decode tok/s: moegate (per expert format) vs transformers eager (and llama.cpp
when `llama_cpp` and a GGUF are available), on the same checkpoint, same threads, in ONE run.

Reference model (default): random Qwen3-MoE, hidden 1024, 8 layers, 64 experts top-8, moe_intermediate
512, 16 / 4 heads, Qwen vocabulary (`moegate model init-random --preset bench`). Writes engine_bench.json
and engine_bench.png; reports ratios. Usage:
    python evals/perf/engine_bench.py [--model DIR] [--gguf-q4 FILE --gguf-q8 FILE] [--quick]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from evals.perf.common import machine_info, save_bar_plot


def _moegate(model: str, fmt: str, dense: str, prompt: list[int], decode: int, defer: int = 0,
             pack_dir: str | None = None, lm_head: str | None = None, fast_dense: str | None = None) -> dict:
    from engine.experts import PlacementConfig
    from engine.llm_engine import LLM
    from engine.sampling_params import SamplingParams

    placement = PlacementConfig(fast_format=fmt, exact_format=fmt, pack_cache_dir=pack_dir)
    t = time.perf_counter()
    llm = LLM(model, dtype=dense, placement=placement, defer=defer, num_kv_blocks=64, prefix_cache=False,
              fast_lm_head=lm_head, fast_dense=fast_dense, progress=False)  # no prefix cache: every prefill is computed
    load_s = time.perf_counter() - t
    llm.generate([prompt[:16]], SamplingParams(max_tokens=2))  # warm-up (kernel build / first-touch)
    params = SamplingParams(max_tokens=decode + 1, ignore_eos=True)
    runs = [_timed_request(llm.engine, prompt, params) for _ in range(3)]
    llm.engine.runner.shutdown()
    pre = min(r[0] for r in runs)
    dec = min(r[1] for r in runs)
    return {"load_s": load_s, "prefill_tok_s": len(prompt) / pre, "decode_tok_s": decode / dec}


def _timed_request(engine, prompt: list[int], params) -> tuple[float, float]:
    """One request through the engine's step loop: (seconds to the first token, seconds for the rest).

    Timing the two phases of the same request keeps prefill noise out of the decode figure (subtracting a
    separately timed prefill from a whole generate did not)."""
    engine.add_request("bench", prompt, params)
    start, first = time.perf_counter(), None
    while engine.has_work():
        if engine.step() and first is None:
            first = time.perf_counter()
    return first - start, time.perf_counter() - first


def _transformers(model: str, dtype: torch.dtype, prompt: list[int], decode: int) -> dict:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, dtype=dtype, attn_implementation="eager").eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        m(ids[:, :16])
        pre = _best(lambda: m(ids))
        total = _best(lambda: m.generate(ids, max_new_tokens=decode + 1, min_new_tokens=decode + 1,
                                         do_sample=False, pad_token_id=0), n=2)
    return {"prefill_tok_s": len(prompt) / pre, "decode_tok_s": decode / max(total - pre, 1e-9)}


def _llama_cpp(gguf: str, prompt: list[int], decode: int, threads: int) -> dict:
    from llama_cpp import Llama  # optional peer: pip install llama-cpp-python

    llm = Llama(model_path=gguf, n_ctx=1024, n_threads=threads, n_batch=512, verbose=False)
    llm.eval(prompt[:16])
    llm.reset()

    def prefill():
        llm.reset()
        llm.eval(prompt)

    pre = _best(prefill)

    def decode_only() -> float:
        llm.reset()
        llm.eval(prompt)
        t = time.perf_counter()
        for _ in range(decode):
            llm.eval([llm.sample(temp=0.0)])
        return time.perf_counter() - t

    dec = min(decode_only() for _ in range(3))
    return {"prefill_tok_s": len(prompt) / pre, "decode_tok_s": decode / dec}


def _best(fn, n: int = 3) -> float:
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def ensure_reference_model(path: Path) -> Path:
    if not (path / "config.json").is_file():
        from engine.random_checkpoint import write_random_checkpoint

        write_random_checkpoint(path, "qwen3_moe", hidden_size=1024, num_layers=8, num_experts=64, top_k=8,
                                moe_intermediate_size=512, num_heads=16, num_kv_heads=4, vocab="qwen",
                                dtype="bfloat16", seed=0)
    return path


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the bench reference model)")
    ap.add_argument("--out", default="evals/out/engine")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--formats", default="int4,int8,bf16")
    ap.add_argument("--dense", default="float32", help="dtype of the dense path for moegate")
    ap.add_argument("--lm-head", default="int8,int4",
                    help="exploration lm_heads of the moegate-*+fast runs (comma list of int4|int8|bf16)")
    ap.add_argument("--fast-dense", default="match",
                    help="exploration attention projections of the +fast runs: int4|int8|bf16, or 'match' for the "
                         "experts' format (as llama.cpp's Q4_0 / Q8_0 quantize attention like the experts)")
    ap.add_argument("--gguf-q4", default=None)
    ap.add_argument("--gguf-q8", default=None)
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--quick", action="store_true", help="short prompt and decode")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.quick:
        args.prompt_len, args.decode = 32, 8
    model = args.model or str(ensure_reference_model(out.parent / "models" / "bench-ref"))
    threads = torch.get_num_threads()
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    prompt = torch.randint(0, min(vocab, 150000), (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    info = machine_info()
    runs: dict[str, dict] = {}
    pack = str(out / "pack")
    plan = [(f"moegate-{f}", _moegate, (model, f, args.dense, prompt, args.decode), {"pack_dir": pack})
            for f in args.formats.split(",")]

    def attn(f: str) -> str:
        return f if args.fast_dense == "match" else args.fast_dense

    plan += [(f"moegate-{f}+fast-lmhead-{h}-attn-{attn(f)}", _moegate, (model, f, args.dense, prompt, args.decode),
              {"pack_dir": pack, "lm_head": h, "fast_dense": attn(f)})
             for f in args.formats.split(",") for h in args.lm_head.split(",")]
    if not args.no_transformers:
        plan += [("transformers-eager-bf16", _transformers, (model, torch.bfloat16, prompt, args.decode), {}),
                 ("transformers-eager-fp32", _transformers, (model, torch.float32, prompt, args.decode), {})]
    for name, gguf in (("llama.cpp-Q4_0", args.gguf_q4), ("llama.cpp-Q8_0", args.gguf_q8)):
        if gguf:
            plan.append((name, _llama_cpp, (gguf, prompt, args.decode, threads), {}))
    # Each run in a fresh process: a run must not inherit the previous one's heap, thread pools or page
    # cache state (in one process a third engine decoded ~40% slower than the same engine run first).
    # moegate's runs get the OpenMP settings `import engine` makes before torch loads (engine.OPENMP_ENV);
    # the baselines run with the environment as it was.
    from engine import OPENMP_ENV, USER_OPENMP_ENV

    spawn = multiprocessing.get_context("spawn")
    for name, fn, fargs, fkw in tqdm(plan, desc="engine bench"):
        for key, value in OPENMP_ENV.items():
            chosen = (USER_OPENMP_ENV[key] or value) if fn is _moegate else USER_OPENMP_ENV[key]
            if chosen is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = chosen
        try:
            with spawn.Pool(1) as pool:
                runs[name] = pool.apply(fn, fargs, fkw)
        except ImportError as exc:
            runs[name] = {"skipped": str(exc)}
        tqdm.write(f"{name}: {runs[name]}")
    ratios = {}
    base = runs.get("transformers-eager-bf16", {})
    for name, r in runs.items():
        if name.startswith("moegate") and "decode_tok_s" in base and "decode_tok_s" in r:
            ratios[f"{name}/transformers-bf16 decode"] = r["decode_tok_s"] / base["decode_tok_s"]
            ratios[f"{name}/transformers-bf16 prefill"] = r["prefill_tok_s"] / base["prefill_tok_s"]
    for q, fmt in (("Q4_0", "int4"), ("Q8_0", "int8")):
        peer = runs.get(f"llama.cpp-{q}", {})
        for name, ours in runs.items():
            if name.split("+")[0] == f"moegate-{fmt}" and "decode_tok_s" in peer and "decode_tok_s" in ours:
                ratios[f"{name}/llama.cpp-{q} decode"] = ours["decode_tok_s"] / peer["decode_tok_s"]
                ratios[f"{name}/llama.cpp-{q} prefill"] = ours["prefill_tok_s"] / peer["prefill_tok_s"]
    result = {"model": model, "prompt_len": args.prompt_len, "decode": args.decode, "threads": threads,
              "dense_dtype": args.dense, "machine": info, "runs": runs, "ratios": ratios,
              "busy_after": machine_info()["cpu_busy_fraction"]}
    (out / "engine_bench.json").write_text(json.dumps(result, indent=2))
    ok = {k: v for k, v in runs.items() if "decode_tok_s" in v}
    save_bar_plot(out / "engine_bench.png", "end-to-end tok/s (higher is better)",
                  {"prefill": {k: v["prefill_tok_s"] for k, v in ok.items()},
                   "decode": {k: v["decode_tok_s"] for k, v in ok.items()}})
    print(json.dumps(ratios, indent=2))
    return result


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
