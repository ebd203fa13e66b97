"""Teacher-forced probes of what the demo model copies from the prompt into its structured answers."""

from __future__ import annotations

import re

import torch

from evals.demo.corpus import assistant_spans, conversations

# each entity in an answer's JSON (group 1): tickers, account numbers, quantities and order sides are drawn at random
# per conversation, so only copying from the user turn (or a tool result) predicts them
COPY_PATTERNS: dict[str, str] = {
    "ticker": r'"symbol": ?"([A-Z]+)"',
    "account": r'"account_id": ?"ACC-(\d+)"',
    "quantity": r'"quantity": ?(\d+)',
    "side": r'"side": ?"(buy|sell)"',
}


def _answer_slots(tokenizer, n: int, seed: int, patterns: dict[str, str]):
    """Per held-out conversation with an entity to predict: (text, token offsets, token ids, [(kind, token indices)]),
    the tokens that spell each match of a `patterns` group 1 inside the assistant's answers (the first starts where the
    entity starts; the last may run past its end, as a closing quote merged into it)."""
    for conv in conversations("heldout", n, seed=seed):
        text = conv.render()
        targets = [(kind, s + m.start(1), s + m.end(1)) for s, e in assistant_spans(text)
                   for kind, p in patterns.items() for m in re.finditer(p, text[s:e])]
        if not targets:
            continue
        enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
        offsets = enc["offset_mapping"]
        starts = {start: i for i, (start, _) in enumerate(offsets)}
        slots = []
        for kind, lo, hi in targets:
            first = starts[lo]
            last = next(i for i in range(first, len(offsets)) if offsets[i][1] >= hi)
            slots.append((kind, list(range(first, last + 1))))
        yield text, offsets, enc["input_ids"], slots


@torch.no_grad()
def copy_probe(model, tokenizer, n: int = 80, seed: int = 13) -> dict[str, list[int]]:
    """{entity: [right, total]}: how often every token of an entity in held-out answers is the model's top choice.

    Teacher-forced on `n` held-out conversations of the default mixture; a model that guesses from the prior instead of
    copying scores about 1/30 on tickers and 1/2 on sides.
    """
    hits = {kind: [0, 0] for kind in COPY_PATTERNS}
    for _, _, ids, slots in _answer_slots(tokenizer, n, seed, COPY_PATTERNS):
        predicted = model(input_ids=torch.tensor([ids])).logits[0].argmax(-1)  # [T]
        for kind, span in slots:
            hits[kind][0] += all(int(predicted[i - 1]) == ids[i] for i in span)
            hits[kind][1] += 1
    return hits


@torch.no_grad()
def side_attention(model, tokenizer, n: int = 80, seed: int = 13) -> torch.Tensor:
    """[layers, heads]: mean attention from the slot that predicts an answer's order side to the user's buy/sell word.

    A model that writes the side right has heads that read the verb from there (the shipped demo model: 0.45 and 0.41
    of two last-layer heads' attention); an untrained one has none (under 0.01). `model` must run eager attention
    (`attn_implementation="eager"`), the only implementation that returns attention weights.
    """
    if model.config._attn_implementation != "eager":
        raise ValueError("side_attention needs a model loaded with attn_implementation='eager'")
    cfg = model.config
    total, count = torch.zeros(cfg.num_hidden_layers, cfg.num_attention_heads), 0
    for text, offsets, ids, slots in _answer_slots(tokenizer, n, seed, {"side": COPY_PATTERNS["side"]}):
        answer = assistant_spans(text)[0][0]
        user = text.rfind("<|im_start|>user", 0, answer)
        verb = re.search(r"(?i)\b(buy|sell)\b", text[user:answer])
        if verb is None:
            continue
        lo, hi = user + verb.start(), user + verb.end()
        keys = [i for i, (s, e) in enumerate(offsets) if s < hi and e > lo]
        attentions = model(input_ids=torch.tensor([ids]), output_attentions=True).attentions
        for _, (i, *_) in slots:
            total += torch.stack([a[0, :, i - 1, keys].sum(-1) for a in attentions])  # [L, H]
            count += 1
    return total / max(count, 1)
