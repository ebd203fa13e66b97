"""Next-token choice per row: logits processors, then greedy or temperature / top-k / top-p sampling."""

from __future__ import annotations

import torch

from engine.sequence import Sequence


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] -> logits [V] with the tokens outside top-k / the top-p nucleus set to -inf."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= top_p  # keep the token that crosses top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, seqs: list[Sequence], vocab_limit: int | None = None) -> list[int]:
    """logits [S, V] fp32 (one row per sequence) -> one token id per sequence."""
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:
        logits[:, vocab_limit:] = float("-inf")  # padded rows of the embedding are not tokens
    tokens = []
    for row, seq in zip(logits, seqs, strict=True):
        p = seq.params
        for proc in p.logits_processors:
            row = proc(seq.output_token_ids, row)
        if p.greedy:
            if not torch.isfinite(row.max()):
                raise RuntimeError(f"request {seq.request_id}: no token is allowed at this step")
            tokens.append(int(torch.argmax(row)))
            continue
        row = apply_top_k_top_p(row / p.temperature, p.top_k, p.top_p)
        probs = torch.softmax(row, dim=-1)
        if torch.isnan(probs).any() or probs.sum() <= 0:
            raise RuntimeError(f"request {seq.request_id}: no token is allowed at this step")
        tokens.append(int(torch.multinomial(probs, 1, generator=seq.generator)))
    return tokens
