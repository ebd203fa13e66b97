"""Train the bundled demo Qwen3-MoE on the procedural corpus (CPU, `--threads`) and save it as a bf16 checkpoint."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from evals.demo.corpus import assistant_spans, conversation, conversations

IGNORE = -100


@dataclass(frozen=True)
class TrainConfig:
    hidden_size: int = 256
    num_layers: int = 4
    num_experts: int = 32
    top_k: int = 2
    moe_intermediate_size: int = 256
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    seq_len: int = 1024
    batch_size: int = 2
    steps: int = 100_000
    time_budget_s: float = 0.0  # > 0: the schedule runs on wall-clock progress and stops at the budget
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    # weight of a non-assistant token's loss against an assistant token's 1: 1.0 trains on all tokens, 0.0 on the
    # answers only; held-out loss is always on assistant tokens
    prompt_loss_weight: float = 1.0
    # weight of the answer tokens that spell a JSON value (tool-call arguments, report fields: what must be copied
    # from the prompt) against the other answer tokens' 1
    value_loss_weight: float = 1.0
    weight_decay: float = 0.1
    router_aux_loss_coef: float = 0.01
    train_conversations: int = 12_000
    eval_conversations: int = 32
    eval_every: int = 50
    save_every: int = 0  # > 0: also save the model to <out>/latest every this many steps (to measure a long run)
    seed: int = 0
    threads: int = 1  # torch CPU threads (the demo machine has 2 cores, shared)
    autocast_bf16: bool = False
    document_mask: bool = False  # attend within each packed conversation only (see lm_loss)
    experts_implementation: str = "grouped_mm"  # ~1.4x faster than "eager" for training on CPU
    init_from: str = ""  # a checkpoint directory to continue training from (a second phase)
    boost_family: str = ""  # draw this share of conversations from these families ("a,b,c", uniformly)
    boost_share: float = 0.0
    qk_norm_lr_mult: float = 1.0  # lr multiplier for the q_norm/k_norm gains (they cap attention sharpness)
    qk_norm_rescale: float = 1.0  # multiply the initial (or loaded) q_norm/k_norm gains (attention logits by its square)

    def __post_init__(self) -> None:
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k {self.top_k} exceeds num_experts {self.num_experts}")
        if not 0.0 <= self.prompt_loss_weight <= 1.0:
            raise ValueError(f"prompt_loss_weight must be in [0, 1], not {self.prompt_loss_weight}")
        if self.value_loss_weight < 1.0:
            raise ValueError(f"value_loss_weight must be at least 1, not {self.value_loss_weight}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")


def build_model(cfg: TrainConfig, tokenizer) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    im_end, eot = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=cfg.hidden_size, intermediate_size=4 * cfg.hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.seq_len, num_experts=cfg.num_experts,
        num_experts_per_tok=cfg.top_k, moe_intermediate_size=cfg.moe_intermediate_size, decoder_sparse_step=1,
        mlp_only_layers=[], norm_topk_prob=True, output_router_logits=True,
        router_aux_loss_coef=cfg.router_aux_loss_coef, tie_word_embeddings=True, rope_theta=10_000.0,
        bos_token_id=None, eos_token_id=[im_end, eot], pad_token_id=eot,
    )
    torch.manual_seed(cfg.seed)
    model = Qwen3MoeForCausalLM(config)
    model.config._experts_implementation = cfg.experts_implementation
    model.generation_config.eos_token_id = [im_end, eot]
    model.generation_config.pad_token_id = eot
    model.generation_config.bos_token_id = None
    model.generation_config.do_sample = False
    return model


# a JSON member's value: a string (group 1, inside its quotes) or a number / literal (group 2)
_JSON_VALUE = re.compile(r'"\w+": ?(?:"((?:[^"\\]|\\.)*)"|(-?\d+(?:\.\d+)?|true|false|null))')


def tokenize_with_mask(tokenizer, text: str) -> tuple[list[int], list[int], list[int]]:
    """Token ids, labels that keep only assistant tokens (others are IGNORE), and a 0/1 flag per token: 1 for
    answer tokens inside a JSON member's value (tool-call arguments, report fields), the entities an answer must
    copy from the prompt."""
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    spans = assistant_spans(text)
    value_spans = [m.span(1) if m.group(1) is not None else m.span(2)
                   for s, e in spans for m in _JSON_VALUE.finditer(text, s, e)]
    labels, flags, j, k = [], [], 0, 0
    for tid, (start, _) in zip(enc["input_ids"], enc["offset_mapping"], strict=True):
        while j < len(spans) and start >= spans[j][1]:
            j += 1
        while k < len(value_spans) and start >= value_spans[k][1]:
            k += 1
        answer = j < len(spans) and spans[j][0] <= start
        labels.append(tid if answer else IGNORE)
        flags.append(int(answer and k < len(value_spans) and value_spans[k][0] <= start))
    return enc["input_ids"], labels, flags


def pack(examples: list[tuple[list[int], list[int], list[int]]], seq_len: int, pad_id: int) -> torch.Tensor:
    """Greedy packing of whole conversations into rows: returns [N, 5, seq_len] (ids, labels, mask, value flags,
    position ids that restart at 0 with each conversation, and with the padding)."""
    rows: list[list[list[int]]] = []
    for example in examples:
        example = [list(x[:seq_len]) for x in example]
        example.append(list(range(len(example[0]))))
        for row in rows[-16:]:  # next-fit over a small window keeps packing linear
            if len(row[0]) + len(example[0]) <= seq_len:
                for part, more in zip(row, example, strict=True):
                    part += more
                break
        else:
            rows.append(example)
    out = torch.full((len(rows), 5, seq_len), 0, dtype=torch.long)
    for r, (ids, labels, values, positions) in enumerate(rows):
        n = len(ids)
        out[r, 0] = torch.tensor(ids + [pad_id] * (seq_len - n))
        out[r, 1] = torch.tensor(labels + [IGNORE] * (seq_len - n))
        out[r, 2, :n] = 1
        out[r, 3, :n] = torch.tensor(values)
        out[r, 4] = torch.tensor(positions + list(range(seq_len - n)))
    return out  # [N, 5, S]


def split_conversations(split: str, n: int, seed: int, boost_family: str = "", boost_share: float = 0.0):
    """The conversations a run trains on: the default mixture, with `boost_share` of them from `boost_family`.

    `boost_family` is one family name or a comma-separated list, drawn uniformly for each boosted conversation.
    """
    families = [f.strip() for f in boost_family.split(",") if f.strip()]
    boosted = random.Random(f"boost:{seed}")
    for i in range(n):
        if boosted.random() >= boost_share or not families:
            yield conversation(split, i, seed, None)
        else:  # one family keeps the old draw sequence; a comma-separated list is drawn uniformly
            yield conversation(split, i, seed, families[0] if len(families) == 1 else boosted.choice(families))


def encode_split(tokenizer, split: str, n: int, seq_len: int, seed: int, boost_family: str = "",
                 boost_share: float = 0.0) -> torch.Tensor:
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    convs = split_conversations(split, n, seed, boost_family, boost_share)
    examples = [tokenize_with_mask(tokenizer, c.render()) for c in tqdm(convs, total=n, desc=f"tokenize {split}")]
    random.Random(seed).shuffle(examples)
    return pack(examples, seq_len, pad_id)


def packed_causal_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                            dropout: float = 0.0, scaling: float | None = None, position_ids: torch.Tensor | None = None,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """Causal attention inside each conversation of a packed row (`position_ids` restart at 0 with each one), for
    transformers' attention interface ("packed_sdpa"): one SDPA call per conversation, so a row costs the sum of its
    conversations' squared lengths rather than the square of the row, and no [S, S] mask is built.

    query [B, H, S, D], key/value [B, KV, S, D] -> [B, S, H, D].
    """
    rows = []
    for b in range(query.shape[0]):
        starts = (position_ids[b] == 0).nonzero().flatten().tolist() + [query.shape[2]]
        rows.append(torch.cat([torch.nn.functional.scaled_dot_product_attention(
            query[b:b + 1, :, s:e], key[b:b + 1, :, s:e], value[b:b + 1, :, s:e], dropout_p=dropout, is_causal=True,
            scale=scaling, enable_gqa=True) for s, e in itertools.pairwise(starts)], 2))
    return torch.cat(rows).transpose(1, 2).contiguous(), None


def _register_packed_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register("packed_sdpa", packed_causal_attention)
    AttentionMaskInterface.register("packed_sdpa", lambda *args, **kwargs: None)  # the boundaries are in position_ids


def lm_loss(model, batch: torch.Tensor, autocast_bf16: bool = False, prompt_weight: float = 0.0,
            value_weight: float = 1.0, document_mask: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted mean next-token cross-entropy, router load-balancing loss) of a [B, 5, S] batch (`pack`).

    Assistant tokens weigh 1, those inside a JSON value `value_weight`, the other real tokens `prompt_weight`:
    0.0 and 1.0 is the plain loss on the answers only. `document_mask`: each conversation in a row attends only to
    itself, from position 0, as it does when served; else a row is one causal sequence (faster per step).
    """
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_bf16):
        if document_mask:  # position ids restart per conversation; attention stays inside each one
            _register_packed_attention()
            implementation = model.config._attn_implementation
            model.set_attn_implementation("packed_sdpa")
            try:
                out = model(input_ids=batch[:, 0], position_ids=batch[:, 4], use_cache=False)
            finally:
                model.set_attn_implementation(implementation)
        else:  # rows pad only at their end, so causal attention alone keeps real tokens off the padding
            out = model(input_ids=batch[:, 0], use_cache=False)
    target = batch[:, 0, 1:]  # [B, S-1]
    answer = batch[:, 1, 1:] != IGNORE
    weight = torch.where(answer, torch.where(batch[:, 3, 1:] == 1, value_weight, 1.0),
                         torch.where(batch[:, 2, 1:] == 1, prompt_weight, 0.0))
    ce = torch.nn.functional.cross_entropy(out.logits[:, :-1].float().flatten(0, 1), target.flatten(), reduction="none")
    aux = out.aux_loss if out.aux_loss is not None else torch.zeros(())
    return (ce * weight.flatten()).sum() / weight.sum().clamp_min(1e-9), aux


@torch.no_grad()
def evaluate(model, data: torch.Tensor, batch_size: int, autocast_bf16: bool = False,
             document_mask: bool = False) -> float:
    """Token-weighted mean cross-entropy over the assistant tokens of `data`."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(data), batch_size):
        batch = data[i:i + batch_size]
        n = int((batch[:, 1, 1:] != IGNORE).sum())
        ce, _ = lm_loss(model, batch, autocast_bf16, document_mask=document_mask)
        total, count = total + float(ce) * n, count + n
    model.train()
    return total / max(count, 1)


def progress_at(step: int, elapsed_s: float, cfg: TrainConfig) -> float:
    """Fraction of training done: by steps, or by wall clock when a time budget is set (shared CPUs)."""
    progress = step / cfg.steps
    if cfg.time_budget_s > 0:
        progress = max(progress, elapsed_s / cfg.time_budget_s)
    return min(progress, 1.0)


def lr_at(step: int, progress: float, cfg: TrainConfig) -> float:
    """Linear warmup over `warmup_steps`, then cosine decay to `min_lr_ratio` over the remaining progress."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def save_loss_curve(history: dict, path: Path, random_loss: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*zip(*history["train"], strict=True), label=f"train (prompt tokens x{history['prompt_loss_weight']:g})",
            alpha=0.6)
    ax.plot(*zip(*history["heldout"], strict=True), "o-", label="held-out (assistant tokens)")
    ax.axhline(random_loss, color="grey", ls="--", label=f"random model ln(V) = {random_loss:.2f}")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("moegate demo-moe training")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save_snapshot(model, tokenizer, path: Path, step: int) -> None:
    """A bf16 copy of the model being trained (with the tokenizer), loadable like the final checkpoint."""
    import copy

    snap = copy.deepcopy(model).to(torch.bfloat16)
    snap.config.output_router_logits = False
    snap.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    (path / "step.txt").write_text(f"{step}\n")


def cpu_name() -> str:
    """The CPU's model name (a run's wall time and step count depend on it)."""
    import platform

    from kernels.cpu_features import detect

    return detect().model or platform.processor() or platform.machine()


def train(cfg: TrainConfig, out_dir: Path, tokenizer) -> dict:
    setup_start = time.time()
    torch.set_num_threads(cfg.threads)
    if cfg.init_from:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(cfg.init_from, dtype=torch.float32)
        model.config.output_router_logits = True
        model.config.router_aux_loss_coef = cfg.router_aux_loss_coef
        model.config._experts_implementation = cfg.experts_implementation
        torch.manual_seed(cfg.seed)
    else:
        model = build_model(cfg, tokenizer)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.mul_(cfg.qk_norm_rescale)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters: {n_params / 1e6:.2f}M", flush=True)
    train_data = encode_split(tokenizer, "train", cfg.train_conversations, cfg.seq_len, cfg.seed,
                              cfg.boost_family, cfg.boost_share)
    eval_data = encode_split(tokenizer, "heldout", cfg.eval_conversations, cfg.seq_len, cfg.seed)
    # QK-norm bounds an attention logit by head_dim**0.5 * (q gain * k gain): ~5.7 at head_dim 32 and unit gains,
    # too flat to single out one token (a ticker to copy) among hundreds; a larger lr lets the gains grow faster
    qk = [p for n, p in model.named_parameters() if n.endswith(("q_norm.weight", "k_norm.weight"))]
    qk_ids = {id(p) for p in qk}
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters()
                if not (p.ndim >= 2 and "embed" not in n) and id(p) not in qk_ids]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0},
                             {"params": qk, "weight_decay": 0.0, "lr_mult": cfg.qk_norm_lr_mult}],
                            lr=cfg.lr, betas=(0.9, 0.95), fused=True)
    history: dict = {"prompt_loss_weight": cfg.prompt_loss_weight, "train": [], "heldout": [], "aux": []}
    gen = torch.Generator().manual_seed(cfg.seed)
    order = torch.randperm(len(train_data), generator=gen)
    start = time.time()
    setup_seconds = start - setup_start  # model init and corpus generation + tokenization, outside the budget
    bar = tqdm(range(cfg.steps), desc="train", total=float("inf") if cfg.time_budget_s > 0 else cfg.steps)  # done=% of budget
    warm_progress, steps_done = None, 0
    for step in bar:
        progress = progress_at(step, time.time() - start, cfg)
        if progress >= 1.0:
            break
        if step == cfg.warmup_steps:
            warm_progress = progress
        # cosine over what is left after warmup
        done = 0.0 if warm_progress is None else (progress - warm_progress) / max(1e-9, 1 - warm_progress)
        idx = order[(torch.arange(cfg.batch_size) + step * cfg.batch_size) % len(order)]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, done, cfg) * group.get("lr_mult", 1.0)
        ce, aux = lm_loss(model, train_data[idx], cfg.autocast_bf16, cfg.prompt_loss_weight, cfg.value_loss_weight,
                          cfg.document_mask)
        (ce + cfg.router_aux_loss_coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps_done = step + 1
        ce, aux = ce.item(), aux.item()
        history["train"].append((step, ce))
        history["aux"].append((step, aux))
        bar.set_postfix(ce=f"{ce:.3f}", aux=f"{aux:.3f}", done=f"{progress:.0%}")
        if (step + 1) % cfg.eval_every == 0:
            held = evaluate(model, eval_data, cfg.batch_size, cfg.autocast_bf16, cfg.document_mask)
            history["heldout"].append((step + 1, held))
            print(f"step {step + 1}: train ce {ce:.4f} held-out ce {held:.4f} "
                  f"elapsed {time.time() - start:.0f}s", flush=True)
        if cfg.save_every and (step + 1) % cfg.save_every == 0:
            save_snapshot(model, tokenizer, out_dir / "latest", step + 1)
    seconds = time.time() - start
    if not history["heldout"] or history["heldout"][-1][0] != steps_done:
        held = evaluate(model, eval_data, cfg.batch_size, cfg.autocast_bf16, cfg.document_mask)
        history["heldout"].append((steps_done, held))
    print(f"final held-out ce {history['heldout'][-1][1]:.4f} after {steps_done} steps, {seconds:.0f}s", flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.config.output_router_logits = False  # inference default; training turns it on
    model.to(torch.bfloat16).save_pretrained(str(out_dir), safe_serialization=True)
    random_loss = math.log(len(tokenizer))
    save_loss_curve(history, out_dir / "loss_curve.png", random_loss)
    tail = [loss for _, loss in history["train"][-50:]]
    metrics = {"config": asdict(cfg), "parameters": n_params, "train_seconds": round(seconds, 1),
               "setup_seconds": round(setup_seconds, 1), "cpu": cpu_name(), "cpu_count": os.cpu_count(),
               "steps": steps_done,
               "tokens_per_step": cfg.batch_size * cfg.seq_len, "train_rows": len(train_data),
               "final_train_ce_last50": sum(tail) / len(tail), "final_heldout_ce": history["heldout"][-1][1],
               "random_model_ce": random_loss, "history": history}
    (out_dir / "training_metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    return metrics


def arg_parser() -> argparse.ArgumentParser:
    """The command line: `--out`, `--tokenizer` and one option per `TrainConfig` field."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("engine/assets/demo-moe"))
    parser.add_argument("--tokenizer", type=Path, help="directory with a trained tokenizer (else train one)")
    for name, value in asdict(TrainConfig()).items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=value)
        else:
            parser.add_argument(flag, type=type(value), default=value)
    return parser


def main() -> None:
    args = arg_parser().parse_args()
    cfg = TrainConfig(**{k: getattr(args, k) for k in asdict(TrainConfig())})
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from evals.demo.tokenizer_build import save_hf_tokenizer, train_tokenizer

    if args.tokenizer is None:
        texts = [c.render() for c in conversations("train", 20_000, cfg.seed)]
        tok = train_tokenizer(texts, 4096)
    else:
        tok = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    args.out.mkdir(parents=True, exist_ok=True)
    save_hf_tokenizer(tok, args.out)
    tokenizer = AutoTokenizer.from_pretrained(str(args.out))
    metrics = train(cfg, args.out, tokenizer)
    print(json.dumps({k: v for k, v in metrics.items() if k != "history"}, indent=1))


if __name__ == "__main__":
    main()
