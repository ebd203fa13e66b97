"""Render the demo model's README.md (model card) from measured training and evaluation figures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _routing_table(rows: list[dict[str, Any]], num_experts: int, top_k: int) -> str:
    lines = ["| layer | busiest expert | top-2 | top-4 | coldest expert | experts for 50% | hottest ids |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['layer']} | {r['top1_share']:.1%} | {r['top2_share']:.1%} | {r['top4_share']:.1%} "
                     f"| {r['coldest_share']:.1%} | {r['experts_for_half']} | {r['hottest']} |")
    uniform = 1 / num_experts
    lines.append(f"\nUniform routing would give every expert {uniform:.2%} of the {top_k} routing slots per token "
                 f"(top-4 = {4 * uniform:.0%}; {num_experts // 2} experts for 50%).")
    return "\n".join(lines)


def _samples(samples: list[dict[str, Any]]) -> str:
    out = []
    for s in samples:
        out.append(f"**{s['title']}** (`{s['family']}`). Last prompt turn:\n\n```text\n{s['user']}\n```\n\n"
                   f"Greedy output (unconstrained):\n\n```text\n{s['generated'].strip()}\n```\n\n"
                   f"Corpus reference:\n\n```text\n{s['reference']}\n```\n")
    return "\n".join(out)


def _capitals_words(card: dict[str, Any]) -> str:
    return "capitals split into letters" if card.get("split_capitals") else "capitals kept whole"


def _split_flag(card: dict[str, Any]) -> str:
    return " --split-capitals" if card.get("split_capitals") else ""


def _tokenizer_entities(card: dict[str, Any]) -> str:
    """How tickers, accounts and prices tokenize, for the pre-tokenizer the checkpoint's tokenizer uses."""
    if not card.get("split_capitals"):
        return """every digit is its own token (`ACC-1012` is `ACC`, `-`, `1`, `0`, `1`, `2`; `668.16` is six tokens),
and each ticker is one token that never carries the space or quote before it. The pre-tokenizer is Qwen2's split
except that an all-capitals word does not absorb the character before it (`DEMO_PRETOKENIZE_REGEX`): with
Qwen2's split, ` MSFT` in prose and `MSFT` after a JSON quote are two unrelated tokens, and copying a ticker
from the user's words into a tool call means learning that mapping for every ticker."""
    return ("every digit is its own token (`668.16` is six tokens), and so is every capital of an all-capitals "
            "word (`AAPL` is `A`, `A`, `P`, `L`; `ACC-1012` is eight tokens), wherever it appears: in prose, after a "
            "JSON quote, in SQL. The pre-tokenizer is Qwen2's split with that rule in front "
            "(`SPLIT_CAPITALS_REGEX`), except for the formats' own words (SQL keywords and types, `JSON`, `XML`), "
            "which stay whole. Copying a ticker is then copying frequent letters, as copying an account number is "
            "copying digits: in 330-step pilots on brief reports, the first token of a ticker was copied 99/105 "
            "with letters against 6/105 with one token per ticker, a rare token whose copy map is learned slowly.")


def _flag(key: str, value: Any) -> str:
    """One `evals.demo.train` option as typed: switches as `--name` / `--no-name`, the time budget in whole seconds."""
    name = key.replace("_", "-")
    if isinstance(value, bool):
        return f"--{name}" if value else f"--no-{name}"
    return f"--{name} {value:.0f}" if key == "time_budget_s" else f"--{name} {value}"


# TrainConfig fields a recipe command does not write as options: `--init-from` is written from the phase order, and
# snapshots and the held-out sample size do not change the trained model
RECIPE_OMITS = ("init_from", "save_every", "eval_conversations")


def _commands(phases: list[dict[str, Any]]) -> str:
    """The `evals.demo.train` command of each phase: every setting that differs from `TrainConfig`'s default."""
    from dataclasses import asdict

    from evals.demo.train import TrainConfig

    defaults = asdict(TrainConfig())
    lines = []
    for i, p in enumerate(phases, start=1):
        out = "engine/assets/demo-moe" if i == len(phases) else f"/tmp/demo_phase{i}"
        flags = [f"--init-from /tmp/demo_phase{i - 1}"] if p["config"].get("init_from") else []
        flags += [_flag(k, v) for k, v in p["config"].items()
                  if k in defaults and k not in RECIPE_OMITS and v != defaults[k]]
        cmd = f"PYTHONPATH=. python -m evals.demo.train --out {out} --tokenizer /tmp/demo_tok"
        for j in range(0, len(flags), 3):
            cmd += " \\\n    " + " ".join(flags[j:j + 3])
        lines.append(cmd)
    return "\n".join(lines)


def _structured_table(structured: dict[str, dict[str, Any]]) -> str:
    lines = ["| kind | tasks | valid | semantically right | fields right |", "|---|---|---|---|---|"]
    for kind, st in structured.items():
        lines.append(f"| {kind} | {st['n']} | {st['valid'] / st['n']:.0%} | {st['correct'] / st['n']:.0%} | "
                     f"{st['field_hits'] / max(1, st['fields']):.0%} |")
    n = sum(st["n"] for st in structured.values())
    right = sum(st["correct"] for st in structured.values())
    hits, fields = (sum(st[k] for st in structured.values()) for k in ("field_hits", "fields"))
    lines.append(f"| **all** | {n} | {sum(st['valid'] for st in structured.values()) / n:.0%} | **{right / n:.0%}** | "
                 f"{hits / max(1, fields):.0%} |")
    return "\n".join(lines)


def _adhoc_data(phases: list[dict[str, Any]]) -> str:
    """A paragraph on the ad-hoc families, for recipes with a phase that boosted them (none: empty)."""
    boosted = [i for i, p in enumerate(phases, start=1) if "adhoc_" in p["config"].get("boost_family", "")]
    if not boosted:
        return ""
    return f"""
Requests as API clients write them (`evals/demo/adhoc.py`; weight 0 in the default mixture, boosted in
phase{"s" if len(boosted) > 1 else ""} {", ".join(map(str, boosted))}): short imperative orders (`Sell 40 shares of XYZ`) answered with a compact JSON
object against the client's own schema, which arrives as `response_format` and so is not in the prompt (key names
drawn from symbol/ticker/sym, qty/quantity/shares/size, optional side, account and limit price); quote calls to
the client's own tool definitions (tool and argument names varied, 0-2 other tools beside it); and bare SQL over
the client's own small tables given as `{{table: [columns]}}` (latest, first, average, extreme, filtered and
grouped prices; the tables in a system turn in 40% of the chats, else only in `response_format`). Tickers are the
demo's instruments or made-up symbols of 1-5 capitals; quantities spread over 1-20, up to 999, round sizes to
50,000 and repeated digits (11, 4444, 300, 505)."""


def _adhoc_intro(phases: list[dict[str, Any]]) -> str:
    trained = any("adhoc_" in p["config"].get("boost_family", "") for p in phases)
    return ", plus the simplest orders, quote tools and price tables in the shapes API clients send them" if trained \
        else ""


def _adhoc_section(card: dict[str, Any]) -> str:
    """The held-out ad-hoc task table, for cards that measured it (older ones: empty)."""
    if "adhoc" not in card:
        return ""
    return f"""### Requests as clients write them

Held-out ad-hoc requests (`evals.demo.corpus.adhoc_heldout_tasks`: a stream no training split draws from, with
key, tool, table and column names that no training chat uses beside the training ones, e.g. `units`, `asset`,
`price_check`, `market_data(instrument, as_of, trade_px)`), decoded as above; a SQL task runs on its own tables
with a few rows per symbol.

{_structured_table(card['adhoc'])}

"""


def _share_right(structured: dict[str, dict[str, Any]]) -> float:
    return sum(st["correct"] for st in structured.values()) / max(1, sum(st["n"] for st in structured.values()))


def _value_note(phases: list[dict[str, Any]]) -> str:
    """A recipe bullet for phases that upweighted the answer tokens inside JSON values (none: empty)."""
    weighted = [(i, p) for i, p in enumerate(phases, start=1) if p["config"].get("value_loss_weight", 1.0) != 1.0]
    if not weighted:
        return ""
    return ("\n- Answer tokens inside JSON values (tool-call arguments, report fields: what must be copied from the "
            "prompt) can weigh more than other answer tokens (`--value-loss-weight`); "
            + "; ".join(f"phase {i} weighted them {p['config']['value_loss_weight']:g} for "
                        f"{p['train_seconds'] / 60:.0f} minutes" for i, p in weighted) + ". "
            "Without it, an earlier recipe's model copied tickers, accounts and quantities but wrote the order side "
            "(`buy`/`sell`) at chance; see *Copying from the prompt* below.")


def _curriculum_note(phases: list[dict[str, Any]]) -> str:
    """A recipe bullet for phases that trained on listed families only (none: empty)."""
    only = [(i, p) for i, p in enumerate(phases, start=1) if p["config"].get("boost_share", 0.0) >= 1.0]
    if not only:
        return ""
    return ("\n- Curriculum: " + "; ".join(
        f"phase {i} trained only on `{p['config']['boost_family']}` ({p['steps']} steps, "
        f"{p['train_seconds'] / 60:.1f} minutes)" for i, p in only) + ". The order side is mostly not a copy: the user "
        "writes ` buy` (with its space) or `Buy`, other tokens than the `buy` in the answer's JSON, so the model needs a head that reads the user's verb and maps it. Started on the full mixture "
        "(prompts of 300-900 tokens), a 52-minute recipe never formed that head and wrote the side at chance, while "
        "copying tickers, accounts and quantities. In brief-ticket chats of about 50 tokens the head forms within "
        "about 100 steps (`evals.demo.probes.side_attention` finds it), and it carries over to tool calls and "
        "full-schema reports when the mixture follows: after the shipped recipe's 20 minutes on it, the side "
        "(teacher-forced, `buy` against `sell`) was right in 36/36 held-out tool calls and reports.")


def _qk_note(phases: list[dict[str, Any]]) -> str:
    """A recipe bullet for phases that rescaled the QK-norm gains (none: empty)."""
    notes = [f"phase {i} multiplied the {'loaded' if p['config'].get('init_from') else 'initial'} gains by "
             f"{p['config']['qk_norm_rescale']} (attention logits by {p['config']['qk_norm_rescale'] ** 2:.2f}) and "
             f"trained them at {p['config'].get('qk_norm_lr_mult', 1.0)}x the lr"
             for i, p in enumerate(phases, start=1) if p["config"].get("qk_norm_rescale", 1.0) != 1.0]
    if not notes:
        return ""
    return ("\n- QK-norm gains: with head_dim 32 and gains near 1, an attention logit is at most about 5.7, too flat "
            "to pick one token out of a 500-token prompt. An earlier recipe trained 55 minutes with unit gains: every "
            "head stayed diffuse (entropy 4-5 nats) and the model copied nothing from the prompt (tickers, accounts "
            "and quantities at chance). Here " + "; ".join(notes) + ".")


def _missed_text(structured: dict[str, dict[str, Any]]) -> str:
    """Which tool-call argument and JSON fields the model gets wrong most often (from `missed_fields`)."""
    missed: dict[str, int] = {}
    for st in structured.values():
        for path, count in st.get("missed_fields", {}).items():
            missed[path] = missed.get(path, 0) + count
    if not missed:
        return "It got every tool-call argument and JSON field right."
    top = sorted(missed.items(), key=lambda kv: -kv[1])[:4]
    return ("The fields it gets wrong most often, with how many tool calls and JSON reports missed each: "
            + ", ".join(f"`{path}` {count}" for path, count in top) + ".")


def _share_fields(structured: dict[str, dict[str, Any]]) -> float:
    return sum(st.get("field_hits", 0) for st in structured.values()) / max(
        1, sum(st.get("fields", 0) for st in structured.values()))


def _structured_examples(structured: dict[str, dict[str, Any]]) -> str:
    out = []
    for kind, st in structured.items():
        for ex in st["examples"][:1]:
            out.append(f"- `{kind}`: output `{ex['output'].strip()}`; expected `{json.dumps(ex['expected'])[:300]}`")
    return "\n".join(out)


def _copy_table(copy: dict[str, list[int]]) -> str:
    """The copy probe (`evals.demo.probes.copy_probe`) as a markdown table."""
    lines = ["| entity in the answer | top choice right | share |", "|---|---|---|"]
    lines += [f"| {kind} | {right}/{n} | {right / max(1, n):.0%} |" for kind, (right, n) in copy.items()]
    return "\n".join(lines)


def _threads_text(phases: list[dict[str, Any]]) -> str:
    """Torch threads of the recipe: one number, or per phase where phases differ."""
    threads = [p["config"].get("threads", 2) for p in phases]
    if len(set(threads)) == 1:
        return str(threads[0])
    by_count: dict[int, list[str]] = {}
    for i, t in enumerate(threads, start=1):
        by_count.setdefault(t, []).append(str(i))
    return " and ".join(f"{t} (phase{'s' if len(ps) > 1 else ''} {', '.join(ps)})" for t, ps in by_count.items())


def _machine_text(phases: list[dict[str, Any]]) -> str:
    """Where the recipe ran: CPU model and core count as the training metrics recorded them."""
    cpus = sorted({f"{p['cpu']} ({p['cpu_count']} cores)" for p in phases if p.get("cpu")})
    return f" on {' and '.join(cpus)}" if cpus else " on a 2-core CPU"


def _setup_text(phases: list[dict[str, Any]]) -> str:
    """Time outside the training budget (building the model, generating and tokenizing the corpus), when recorded."""
    if not all("setup_seconds" in p for p in phases):
        return ""
    setup = sum(p["setup_seconds"] for p in phases) / 60
    total = setup + sum(p["train_seconds"] for p in phases) / 60
    return f", plus {setup:.1f} minutes of corpus generation and tokenization: {total:.0f} minutes end to end"


def _document_note(phases: list[dict[str, Any]]) -> str:
    """A recipe clause for runs with `--document-mask` (none: empty)."""
    if not all(p["config"].get("document_mask") for p in phases):
        return ""
    return (" Each conversation attends only to itself, from position 0, as when it is served (`--document-mask`: "
            "position ids restart per conversation and attention runs once per conversation, which is also cheaper "
            "than causal attention over the whole row).")


def _phases_text(phases: list[dict[str, Any]]) -> str:
    lines = ["| phase | start | peak lr | data seed | mix | steps | tokens | wall time | held-out loss at end |",
             "|---|---|---|---|---|---|---|---|---|"]
    for i, p in enumerate(phases, start=1):
        c = p["config"]
        start = f"end of phase {i - 1}" if c.get("init_from") else "random init"
        mix = f"+{c['boost_share']:.0%} {c['boost_family']}" if c.get("boost_share") else "default"
        lines.append(f"| {i} | {start} | {c['lr']} | {c['seed']} | {mix} | {p['steps']} | "
                     f"{p['steps'] * p['tokens_per_step'] / 1e6:.2f}M | {p['train_seconds'] / 60:.1f} min | "
                     f"{p['final_heldout_ce']:.3f} |")
    lines.append("\nHeld-out loss at the end of a phase: 32 held-out conversations of that phase's seed, assistant "
                 "tokens.")
    return "\n".join(lines)


def write_card(checkpoint: Path, card: dict[str, Any], phases: list[dict[str, Any]]) -> None:
    train = phases[-1]
    cfg = train["config"]
    hist = train["history"]
    minutes = sum(p["train_seconds"] for p in phases) / 60
    steps = sum(p["steps"] for p in phases)
    tokens = sum(p["steps"] * p["tokens_per_step"] for p in phases)
    ov = card["overlap"]
    overlap_families = ", ".join(f"{k} {v:.0%}" for k, v in ov["per_family"].items() if v > 0) or "none"
    text = f"""---
license: apache-2.0
library_name: transformers
pipeline_tag: text-generation
tags: [qwen3_moe, moe, demo, tool-calling, finance]
---

# moegate demo-moe

A small **Qwen3-MoE** trained from scratch, on a 2-core CPU, on a procedural corpus of financial-agent
conversations. It is the default model of `moegate serve`: a fresh clone serves it with no training.
It exists so the engine has a *trained* MoE to run: routing in a trained MoE is skewed (hot and cold experts),
which is what hot-expert placement, mixed precision and expert deferral exploit; random weights only prove
numerics. It is a toy: it knows ~30 tickers, 12 accounts, 5 tools, 3 report schemas, one SQL schema and
about two dozen market concepts{_adhoc_intro(phases)}, and nothing else.

## Architecture

| | |
|---|---|
| architecture | `Qwen3MoeForCausalLM` (transformers), all layers sparse |
| parameters | {card['parameters'] / 1e6:.2f}M total (tied embeddings), {card['active_parameters'] / 1e6:.2f}M active per token |
| layers / hidden | {cfg['num_layers']} / {cfg['hidden_size']} |
| attention | {cfg['num_heads']} query heads, {cfg['num_kv_heads']} KV heads, head_dim {cfg['head_dim']}, RoPE θ=10000, QK-norm |
| experts | {cfg['num_experts']} routed experts, top-{cfg['top_k']}, moe_intermediate {cfg['moe_intermediate_size']}, normalised top-k weights |
| context | {cfg['seq_len']} tokens |
| vocabulary | {card['vocab_size']} (byte-level BPE, Qwen2 pre-tokenizer split with {_capitals_words(card)}, Qwen special-token strings) |
| weights | `model.safetensors`, bfloat16 |

## Tokenizer and chat template

Byte-level BPE trained with `tokenizers` on 20,000 rendered training conversations
(`evals/demo/tokenizer_build.py`). Asked for 4,096 tokens, the trainer stops at {card['vocab_size']}: the
procedural corpus has no more mergeable pairs inside the pre-tokenizer's pieces (digits are single tokens),
so a bigger vocabulary buys nothing. Entities tokenize the way copying needs, as the same tokens wherever they
appear: {_tokenizer_entities(card)} Special tokens, same
strings as Qwen2.5/Qwen3: `<|endoftext|>` (id 0, pad), `<|im_start|>`, `<|im_end|>` (eos), `<tool_call>`,
`</tool_call>`, `<tool_response>`, `</tool_response>`, `<think>`, `</think>`.
The chat template (in `tokenizer_config.json`) is Qwen2.5's ChatML with tools: the tools are listed as JSON
inside `<tools></tools>` in the system turn, an assistant tool call is
`<tool_call>\\n{{"name": ..., "arguments": {{...}}}}\\n</tool_call>` (arguments as a dict or a JSON string),
and tool results come back as `<tool_response>` blocks inside a user turn. `generation_config.json` stops on
`<|im_end|>` and `<|endoftext|>`.

## Training data

`evals/demo/corpus.py`: seeded, procedural, no downloads. Conversation families (weights): market concepts in
prose (14%), commentary on a given list of moves (8%), tool calls with tool results and a prose answer —
quote (10%), price history (6%), positions (7%), order (10%), risk check then order (8%), risk check (4%) —,
JSON reports against three fixed schemas (`order_ticket`, `position_summary`, `risk_report`; 19%), written
compact (`,` and `:` separators, as the gateway's `response_format` JSON grammar emits them), and SQLite
queries over a six-table trading database (`instruments, prices, accounts, positions, orders, trades`; 14%),
half of them asked for in a ```` ```sql ```` block and half as a bare query (the gateway's `response_format`
`sql`, constrained from the first token).{_adhoc_data(phases)}
Tickers, accounts, sides, quantities and prices are drawn at random per conversation and the answer repeats them from the user
turn (or a tool result), so the only way to get the arguments right is to copy them from the context.

Train and held-out splits are different seed streams of the same generator (`"train"` / `"heldout"`). Short
conversations recur verbatim across the streams, as in any templated data: of {ov['heldout']} held-out
conversations, {ov['share']:.1%} occur in the {ov['train']:,} distinct training conversations
(by family: {overlap_families}). Held-out loss therefore measures fit to the distribution, not novelty;
`heldout_tasks(..., exclude=...)` with the training conversations (`evals.demo.train.split_conversations`
for each phase above) gives tasks the model never saw verbatim.

## Recipe

```
PYTHONPATH=. python -m evals.demo.tokenizer_build --out /tmp/demo_tok --vocab-size 4096{_split_flag(card)}
{_commands(phases)}
PYTHONPATH=. python -m evals.demo.model_card   # measures and writes this card
```

- AdamW (β=0.9/0.95, weight decay {cfg['weight_decay']} on matrices), peak lr {cfg['lr']}, linear warmup over
  {cfg['warmup_steps']} steps, cosine decay to {cfg['min_lr_ratio']:.0%} of peak, gradient clipping at 1.0, fp32
  (bf16 autocast is slower on this CPU: no bf16 arithmetic).
- Batches of {cfg['batch_size']} × {cfg['seq_len']} tokens: whole conversations packed into rows.{_document_note(phases)}
- Experts computed with transformers' `grouped_mm` experts implementation (about 1.4× faster per training step
  than the per-expert `eager` loop on this CPU).
- Router load-balancing loss (`output_router_logits=True`, `router_aux_loss_coef={cfg['router_aux_loss_coef']}`).
- Loss on every token, with the prompt's tokens (system, user and tool turns) weighted
  {cfg['prompt_loss_weight']} against the answers' 1 (`--prompt-loss-weight`). In equal-step pilots (246 steps)
  loss on all tokens reached a held-out loss of 0.88 on assistant tokens against 1.10 for loss on assistant
  tokens only: the prompt tokens (tool JSON schemas, SQL DDL, report schemas) teach exactly the syntax the
  answers use, but most of them are random prices and schema text, and at full weight they dominate the
  gradient. The held-out figures below are on **assistant tokens** (the answers), the number that
  matters.{_curriculum_note(phases)}{_value_note(phases)}{_qk_note(phases)}
- The schedule runs on wall-clock progress (`--time-budget-s`), so a run takes the same time on a slower or
  busier machine and trains fewer steps there. **{steps} steps, {tokens / 1e6:.2f}M tokens, {minutes:.1f} minutes**
  of training with torch threads = {_threads_text(phases)}{_machine_text(phases)}{_setup_text(phases)}; one uncontended
  training step of this recipe takes {card['step_seconds']['1']:.2f} s at 1 thread and
  {card['step_seconds']['2']:.2f} s at 2 threads on the machine that measured this card ({card.get('step_cpu', 'not recorded')}).

{_phases_text(phases)}

## Results

| | held-out loss, assistant tokens | held-out loss, all tokens |
|---|---|---|
| random init (same config) | {card['random']['assistant']:.3f} | {card['random']['all']:.3f} |
| ln(vocab) | {card['ln_vocab']:.3f} | {card['ln_vocab']:.3f} |
| **demo-moe** | **{card['trained']['assistant']:.3f}** | **{card['trained']['all']:.3f}** |

Measured on {card['heldout_conversations']} held-out conversations (`python -m evals.demo.model_card`).
Final training loss (mean of the last 50 steps, prompt tokens weighted {hist['prompt_loss_weight']}): {train['final_train_ce_last50']:.3f}.

![loss curve](loss_curve.png)

### Structured tasks under constrained decoding

Held-out tool-call, JSON and SQL tasks (`evals.demo.corpus.heldout_tasks(n, seed=1, exclude=...)`, skipping
every conversation that occurs verbatim in the training data, so none was seen in training),
decoded greedily by the moegate engine in execution mode under the gateway's constraints (tool schemas inside
the tool-call syntax, the report's JSON Schema, the SQL grammar of the trading database) — the same code as
`moegate eval` (`evals.report.structured_tasks`). *Valid*: passes the gateway's validator. *Semantically
right*: a tool call with exactly the expected name and arguments, a JSON object equal to the expected one, a
query whose result rows equal the reference query's. *Fields right*: the share of expected tool-call argument
and JSON leaf fields reproduced exactly at their path, or for SQL of the reference query's string/number literals
found in the output (a model that copies some of the user's entities scores here but not in the exact column).

{_structured_table(card['structured'])}

{_structured_examples(card['structured'])}

{_adhoc_section(card)}### Copying from the prompt

Tickers, account numbers, quantities and order sides are drawn at random per conversation, so an answer gets them
right only by copying them from the user turn or a tool result. Teacher-forced on held-out conversations
(`evals.demo.probes.copy_probe`): how often every token of each in the answer's JSON is the model's top choice
(guessing from the prior scores about 1/30 on tickers and 1/2 on sides).

{_copy_table(card['copy'])}

### Routing skew

Share of the top-{cfg['top_k']} routing slots taken per expert on held-out conversations, busiest first:

{_routing_table(card['routing'], cfg['num_experts'], cfg['top_k'])}

## Sample generations

Greedy decoding by the moegate engine in **exploration mode** (unconstrained) on held-out prompts; the gateway
adds constrained decoding for tool calls, JSON and SQL:

{_samples(card['samples'])}

## Limitations

A toy trained for {minutes:.0f} minutes on a 2-core CPU ({tokens / 1e6:.1f}M tokens). Its
structured answers are exactly right in {_share_right(card['structured']):.0%} of the held-out tasks above, and
{_share_fields(card['structured']):.0%} of the expected fields are right. {_missed_text(card['structured'])}
It does no real arithmetic and answers anything outside its few topics with corpus-shaped text. Structured
outputs must go through the gateway's constrained decoding and validation. Not advice.
"""
    (checkpoint / "README.md").write_text(text)
