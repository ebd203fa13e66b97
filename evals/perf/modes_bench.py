"""Exploration vs execution: deferral speedup (decode tok/s, d = 0..k/2) and drift (KL, top-1 vs strict),
the overlap of deferred expert work with the dense path (a timeline), and the cost of execution mode.

Drift is measured by teacher forcing: every run follows the strict run's greedy tokens, so each step's
next-token distribution is compared on the same prefix. Writes modes_bench.json, modes_bench.png and
modes_timeline.png. Usage: python -m evals.perf.modes_bench [--model DIR] [--quick]

`--streams` measures instead how execution scales with concurrent streams (evals/perf/mode_streams.py):
1 vs 8 execution streams against 8 exploration streams through the engine API and the gateway, with the
default policy, and one execution vs one exploration stream (modes_streams.json / .png).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from evals.perf.common import decode_rate, machine_info

DEMO = Path(__file__).resolve().parents[2] / "engine" / "assets" / "demo-moe"


class TeacherForcing:
    """Logits processor: records each row, then allows only the reference trajectory's next token."""

    def __init__(self, tokens: list[int] | None) -> None:
        self.tokens, self.rows = tokens, []

    def __call__(self, generated, row):
        self.rows.append(row.clone())
        if self.tokens is None:
            return row
        forced = torch.full_like(row, float("-inf"))
        forced[self.tokens[len(generated)]] = 0.0
        return forced


def _llm(model: str, defer: int, fmt: str, formatting_layers: int):
    from engine.experts import PlacementConfig
    from engine.llm_engine import LLM

    placement = PlacementConfig(fast_format=fmt, exact_format="bf16", formatting_layers=formatting_layers)
    return LLM(model, placement=placement, defer=defer, num_kv_blocks=256, prefix_cache=False, progress=False)


def _prompts(llm, n: int) -> list[list[int]]:
    tok = llm.tokenizer
    questions = ["What moves the 10-year yield this week?", "Summarise the risk on a long AAPL position.",
                 "Should we hedge EUR exposure before the ECB meeting?", "Explain the bid-ask spread on TSLA.",
                 "How does duration affect a bond portfolio?", "What is the VaR of a 60/40 portfolio?"]
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in questions[:n]]


def _drift(model, prompts, defer, fmt, layers, reference) -> dict:
    from engine.sampling_params import SamplingParams

    llm = _llm(model, defer, fmt, layers)
    procs = [TeacherForcing(ref) for ref in reference]
    llm.generate(prompts, [SamplingParams(max_tokens=len(r), ignore_eos=True, logits_processors=[p])
                           for r, p in zip(reference, procs, strict=True)])
    llm.engine.runner.shutdown()
    return {"rows": torch.cat([torch.stack(p.rows) for p in procs])}


def _timeline(model: str, fmt: str, defer: int, prompt: list[int]) -> list[tuple[str, float, float]]:
    """(lane, start, end) intervals of one decode step: main-thread layers and the deferred expert work."""
    from engine.sampling_params import SamplingParams

    llm = _llm(model, defer, fmt, 0)
    engine = llm.engine
    spans: list[tuple[str, float, float]] = []
    worker = engine.runner.expert_worker
    real_submit = worker.submit

    def timed(fn, *a):
        t = time.perf_counter()
        out = fn(*a)
        spans.append(("deferred experts (worker)", t, time.perf_counter()))
        return out

    worker.submit = lambda fn, *a: real_submit(timed, fn, *a)
    hooks = []
    for i, layer in enumerate(engine.runner.model.model.layers):
        hooks.append(layer.self_attn.register_forward_pre_hook(lambda m, a, i=i: spans.append((f"_a{i}", time.perf_counter(), 0))))
        hooks.append(layer.self_attn.register_forward_hook(lambda m, a, o, i=i: spans.append((f"_A{i}", time.perf_counter(), 0))))
        hooks.append(layer.mlp.register_forward_pre_hook(lambda m, a, i=i: spans.append((f"_m{i}", time.perf_counter(), 0))))
        hooks.append(layer.mlp.register_forward_hook(lambda m, a, o, i=i: spans.append((f"_M{i}", time.perf_counter(), 0))))
    engine.add_request("t", prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    engine.step()
    spans.clear()
    engine.step()  # one decode step, recorded
    for h in hooks:
        h.remove()
    engine.runner.shutdown()
    marks = {name: t for name, t, _ in spans if name.startswith("_")}
    out = [s for s in spans if not s[0].startswith("_")]
    for i in range(len(engine.runner.model.model.layers)):
        out.append(("attention (main)", marks[f"_a{i}"], marks[f"_A{i}"]))
        out.append(("MoE now (main)", marks[f"_m{i}"], marks[f"_M{i}"]))
    t0 = min(s[1] for s in out)
    return [(lane, (a - t0) * 1e3, (b - t0) * 1e3) for lane, a, b in out]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEMO))
    ap.add_argument("--out", default="evals/out/modes")
    ap.add_argument("--format", default="int4", help="fast (exploration) expert format")
    ap.add_argument("--formatting-layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--streams", action="store_true", help="concurrent execution streams (mode_streams.py)")
    args, rest = ap.parse_known_args(argv)
    if args.streams:
        from evals.perf.mode_streams import main as streams_main

        return streams_main(["--model", args.model, "--out", args.out, *rest])
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from engine.config import ModelConfig
    from engine.sampling_params import SamplingParams

    cfg = ModelConfig.from_dir(args.model)
    depths = list(range(0, cfg.top_k // 2 + 1))
    n_prompts = 2 if args.quick else 6
    tokens = 8 if args.quick else args.tokens
    strict = _llm(args.model, 0, args.format, args.formatting_layers)
    prompts = _prompts(strict, n_prompts)
    reference = [o.token_ids for o in strict.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))]
    base = _drift(args.model, prompts, 0, args.format, args.formatting_layers, reference)["rows"]
    results = {"model": args.model, "top_k": cfg.top_k, "format": args.format, "machine": machine_info(),
               "depths": {}}
    for d in tqdm(depths, desc="deferral depth"):
        llm = _llm(args.model, d, args.format, args.formatting_layers)
        rate = decode_rate(llm, prompts[:1], tokens, "exploration")
        llm.engine.runner.shutdown()
        rows = base if d == 0 else _drift(args.model, prompts, d, args.format, args.formatting_layers, reference)["rows"]
        valid = torch.isfinite(base[0])  # padded vocabulary rows are -inf in both
        kl = torch.nn.functional.kl_div(rows[:, valid].log_softmax(-1), base[:, valid].log_softmax(-1),
                                        log_target=True, reduction="none").sum(-1)
        results["depths"][d] = {"decode_tok_s": rate, "kl_mean": kl.mean().item(), "kl_max": kl.max().item(),
                                "top1_agreement": (rows.argmax(-1) == base.argmax(-1)).float().mean().item()}
        tqdm.write(f"d={d}: {results['depths'][d]}")
    d0 = results["depths"][0]["decode_tok_s"]
    for r in results["depths"].values():
        r["speedup_vs_strict"] = r["decode_tok_s"] / d0
    results["execution_decode_tok_s"] = decode_rate(strict, prompts[:1], tokens, "execution")
    results["execution_cost"] = d0 / results["execution_decode_tok_s"]
    strict.engine.runner.shutdown()
    timeline = _timeline(args.model, args.format, max(depths), prompts[0]) if max(depths) else []
    results["timeline_ms"] = timeline
    (out / "modes_bench.json").write_text(json.dumps(results, indent=2))
    _plots(out, results, timeline)
    return results


def _plots(out: Path, results: dict, timeline) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ds = sorted(results["depths"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(ds, [results["depths"][d]["speedup_vs_strict"] for d in ds], "o-")
    a.set_xlabel("deferred experts per token (d)")
    a.set_ylabel("decode speed vs strict (x)")
    a.set_title("deferral speedup")
    b.plot(ds, [results["depths"][d]["top1_agreement"] for d in ds], "o-", label="top-1 agreement")
    b.plot(ds, [results["depths"][d]["kl_mean"] for d in ds], "s-", label="mean KL (nats)")
    b.set_xlabel("d")
    b.set_title("drift vs strict (teacher-forced)")
    b.legend()
    fig.tight_layout()
    fig.savefig(out / "modes_bench.png", dpi=110)
    plt.close(fig)
    if timeline:
        lanes = sorted({lane for lane, _, _ in timeline})
        fig, ax = plt.subplots(figsize=(11, 2.5))
        for y, lane in enumerate(lanes):
            ax.broken_barh([(s, e - s) for ln, s, e in timeline if ln == lane], (y - 0.4, 0.8))
        ax.set_yticks(range(len(lanes)), lanes)
        ax.set_xlabel("ms within one decode step")
        ax.set_title("deferred expert work overlapping the dense path")
        fig.tight_layout()
        fig.savefig(out / "modes_timeline.png", dpi=110)
        plt.close(fig)


if __name__ == "__main__":
    main()
