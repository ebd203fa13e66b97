"""Measure the trained demo model (held-out loss, random baseline, routing skew, samples) and write its card."""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from evals.demo.card_text import write_card
from evals.demo.corpus import conversation, conversations
from evals.demo.probes import copy_probe
from evals.demo.train import IGNORE, cpu_name, save_loss_curve, split_conversations, tokenize_with_mask

SAMPLE_PROMPTS: tuple[tuple[str, str, int], ...] = (  # (title, family, held-out index)
    ("Free text: a market concept", "concept", 0),
    ("Free text: a market concept", "concept", 5),
    ("Free text: commentary on given moves", "market_summary", 0),
    ("Tool call: quote", "quote", 0),
    ("Tool call: order", "order", 2),
    ("SQL over the trading database", "sql", 0),
    ("JSON report against a schema", "risk_report", 0),
)


@torch.no_grad()
def heldout_loss(model, tokenizer, n: int, seed: int = 0) -> dict[str, float]:
    """Token-weighted cross-entropy of held-out conversations, on assistant tokens and on all tokens."""
    sums = {"assistant": [0.0, 0], "all": [0.0, 0]}
    for conv in tqdm(list(conversations("heldout", n, seed)), desc="held-out loss"):
        ids, labels, _ = tokenize_with_mask(tokenizer, conv.render())
        input_ids = torch.tensor([ids])  # [1, T]
        logits = model(input_ids=input_ids).logits[0, :-1].float()  # [T-1, V]
        nll = torch.nn.functional.cross_entropy(logits, input_ids[0, 1:], reduction="none")  # [T-1]
        mask = torch.tensor(labels[1:]) != IGNORE
        sums["assistant"][0] += float(nll[mask].sum())
        sums["assistant"][1] += int(mask.sum())
        sums["all"][0] += float(nll.sum())
        sums["all"][1] += nll.numel()
    return {k: total / count for k, (total, count) in sums.items()}


@torch.no_grad()
def routing_skew(model, tokenizer, n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Per layer: share of top-k routing slots taken by the busiest experts on held-out conversations."""
    cfg = model.config
    counts = torch.zeros(cfg.num_hidden_layers, cfg.num_experts)  # [L, E]
    for conv in tqdm(list(conversations("heldout", n, seed)), desc="routing"):
        ids = tokenizer(conv.render(), add_special_tokens=False)["input_ids"]
        out = model(input_ids=torch.tensor([ids]), output_router_logits=True)
        for layer, logits in enumerate(out.router_logits):  # each [T, E]
            top = logits.float().topk(cfg.num_experts_per_tok, dim=-1).indices  # [T, k]
            counts[layer] += torch.bincount(top.flatten(), minlength=cfg.num_experts).float()
    rows = []
    for layer in range(cfg.num_hidden_layers):
        share = (counts[layer] / counts[layer].sum()).sort(descending=True)
        cumulative = share.values.cumsum(0)
        rows.append({
            "layer": layer, "top1_share": float(share.values[0]), "top2_share": float(cumulative[1]),
            "top4_share": float(cumulative[3]), "coldest_share": float(share.values[-1]),
            "experts_for_half": int((cumulative < 0.5).sum()) + 1, "hottest": share.indices[:4].tolist(),
        })
    return rows


def exploration_samples(checkpoint: Path, prompts=SAMPLE_PROMPTS, max_tokens: int = 160) -> list[dict[str, Any]]:
    """Greedy continuations of held-out prompts by the moegate engine in exploration mode (unconstrained)."""
    from engine.sampling_params import SamplingParams
    from evals.report import _llm

    llm = _llm(str(checkpoint))
    tok, out = llm.tokenizer, []
    for title, family, index in tqdm(prompts, desc="samples"):
        conv = conversation("heldout", index, family=family)
        messages = conv.messages[:conv.answer_index]
        ids = tok.encode(tok.apply_chat_template(messages, tools=conv.tools))
        llm.engine.add_request(title, ids, SamplingParams(max_tokens=max_tokens), mode="exploration")
        result = None
        while llm.engine.has_work():
            for o in llm.engine.step():
                result = o
        out.append({"title": title, "family": family, "user": messages[-1]["content"], "generated": result.text,
                    "reference": _reference(conv.messages[conv.answer_index])})
    return out


def _reference(message: dict[str, Any]) -> str:
    if message.get("tool_calls"):
        fn = message["tool_calls"][0]["function"]
        return f'<tool_call>\n{{"name": "{fn["name"]}", "arguments": {json.dumps(fn["arguments"])}}}\n</tool_call>'
    return message["content"]


def trained_conversations(phases: list[dict[str, Any]]) -> frozenset[str]:
    """The rendered conversations the model trained on, over all phases."""
    return frozenset(conv.render() for p in phases for conv in split_conversations(
        "train", p["config"]["train_conversations"], p["config"]["seed"], p["config"].get("boost_family", ""),
        p["config"].get("boost_share", 0.0)))


def split_overlap(seen: frozenset[str], n_heldout: int = 1000) -> dict[str, Any]:
    """Share of held-out conversations that occur verbatim among the conversations the model trained on."""
    per_family: dict[str, list[int]] = {}
    for conv in conversations("heldout", n_heldout):
        counts = per_family.setdefault(conv.kind, [0, 0])
        counts[0] += conv.render() in seen
        counts[1] += 1
    total = sum(c[0] for c in per_family.values())
    return {"heldout": n_heldout, "train": len(seen), "share": total / n_heldout,
            "per_family": {k: v[0] / v[1] for k, v in sorted(per_family.items())}}


def measure(checkpoint: Path, n_loss: int, n_routing: int, n_tasks: int,
            seen: frozenset[str] = frozenset()) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeForCausalLM

    from evals.demo.corpus import adhoc_heldout_tasks
    from evals.report import structured_tasks

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint)).float().eval()
    torch.manual_seed(0)
    random_model = Qwen3MoeForCausalLM(model.config).float().eval()
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "active_parameters": active_parameters(model),
        "vocab_size": len(tokenizer), "ln_vocab": math.log(len(tokenizer)),
        "split_capitals": splits_capitals(checkpoint),
        "heldout_conversations": n_loss,
        "trained": heldout_loss(model, tokenizer, n_loss), "random": heldout_loss(random_model, tokenizer, n_loss),
        "routing": routing_skew(model, tokenizer, n_routing),
        "copy": copy_probe(model, tokenizer),
        "structured": {k: {f: v[f] for f in ("n", "valid", "correct", "field_hits", "fields", "examples",
                                              "missed_fields") if f in v}
                       for k, v in structured_tasks(str(checkpoint), n_tasks, exclude=seen).items()},
        "adhoc": {k: {f: v[f] for f in ("n", "valid", "correct", "field_hits", "fields", "examples") if f in v}
                  for k, v in structured_tasks(str(checkpoint), n_tasks // 2,
                                               tasks=adhoc_heldout_tasks(n_tasks // 2, exclude=seen)).items()},
        "samples": exploration_samples(checkpoint),
    }


def splits_capitals(checkpoint: Path) -> bool:
    """Whether the checkpoint's tokenizer was built with `tokenizer_build --split-capitals` (its pre-tokenizer pattern)."""
    from evals.demo.tokenizer_build import SPLIT_CAPITALS_REGEX

    pre = json.loads((checkpoint / "tokenizer.json").read_text(encoding="utf-8"))["pre_tokenizer"]
    steps = pre.get("pretokenizers", [pre])
    return any(p.get("pattern", {}).get("Regex") == SPLIT_CAPITALS_REGEX for p in steps)


def active_parameters(model) -> int:
    """Parameters one token uses: everything except the routed experts it is not sent to."""
    cfg = model.config
    experts = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    return sum(p.numel() for p in model.parameters()) - experts + experts * cfg.num_experts_per_tok // cfg.num_experts


def step_seconds(checkpoint: Path, config: dict[str, Any], threads: int, steps: int = 4) -> float:
    """Best wall time of one training step (forward, backward, AdamW) of the recipe's model at `threads` threads, on
    the recipe's first packed training rows with its loss weights and attention (`document_mask`)."""
    from dataclasses import fields

    from transformers import AutoTokenizer

    from evals.demo.train import TrainConfig, build_model, encode_split, lm_loss

    cfg = TrainConfig(**{f.name: config[f.name] for f in fields(TrainConfig) if f.name in config})
    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    model = build_model(cfg, tokenizer)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, fused=True)
    # every chat is longer than 32 tokens, so this many fill at least batch_size rows
    rows = encode_split(tokenizer, "train", cfg.batch_size * cfg.seq_len // 32, cfg.seq_len, cfg.seed,
                        cfg.boost_family, cfg.boost_share)
    batch = rows[:cfg.batch_size]  # [B, 5, S]
    best = float("inf")
    for _ in range(steps):
        start = time.perf_counter()
        ce, aux = lm_loss(model, batch, cfg.autocast_bf16, cfg.prompt_loss_weight, cfg.value_loss_weight,
                          cfg.document_mask)
        (ce + cfg.router_aux_loss_coef * aux).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        best = min(best, time.perf_counter() - start)
    torch.set_num_threads(previous)
    return best


def training_metric_files(checkpoint: Path) -> list[Path]:
    """Earlier phases (`training_metrics_phase<N>.json`) in order, then the last phase's `training_metrics.json`."""
    earlier = sorted(checkpoint.glob("training_metrics_phase*.json"), key=lambda p: int(p.stem.rsplit("phase", 1)[1]))
    return earlier + [checkpoint / "training_metrics.json"]


def merge_histories(phases: list[dict[str, Any]]) -> dict[str, Any]:
    """One loss history across training phases, later phases' steps offset by the earlier ones."""
    merged: dict[str, Any] = {"prompt_loss_weight": phases[-1]["history"]["prompt_loss_weight"], "train": [],
                              "heldout": []}
    offset = 0
    for phase in phases:
        for key in ("train", "heldout"):
            merged[key] += [(step + offset, loss) for step, loss in phase["history"][key]]
        offset += phase["steps"]
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checkpoint", type=Path, default=Path("engine/assets/demo-moe"))
    parser.add_argument("--loss-conversations", type=int, default=48)
    parser.add_argument("--routing-conversations", type=int, default=48)
    parser.add_argument("--tasks", type=int, default=120, help="held-out structured tasks (constrained decoding)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    phases = [json.loads(p.read_text()) for p in training_metric_files(args.checkpoint)]
    seen = trained_conversations(phases)
    card = measure(args.checkpoint, args.loss_conversations, args.routing_conversations, args.tasks, seen)
    card["overlap"] = split_overlap(seen)
    card["step_seconds"] = {str(t): step_seconds(args.checkpoint, phases[-1]["config"], t) for t in (1, 2)}
    card["step_cpu"] = f"{cpu_name()}, {os.cpu_count()} cores"
    (args.checkpoint / "card_metrics.json").write_text(json.dumps(card, indent=1) + "\n")
    save_loss_curve(merge_histories(phases), args.checkpoint / "loss_curve.png", card["ln_vocab"])
    write_card(args.checkpoint, card, phases)
    print(json.dumps({k: card[k] for k in ("parameters", "active_parameters", "trained", "random")}, indent=1))
    print(json.dumps({k: {f: v[f] for f in ("n", "valid", "correct", "field_hits", "fields")}
                      for k, v in card["structured"].items()}))


if __name__ == "__main__":
    main()
