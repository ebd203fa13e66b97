"""Next-token choice per row: logits processors, then greedy or temperature / top-k / top-p sampling."""

from __future__ import annotations

import torch

from engine.errors import EngineError
from engine.sequence import Sequence

# Temperatures below this sample like greedy (dividing by them overflows fp32).
MIN_TEMPERATURE = 1e-5


class SamplingError(EngineError):
    """No token could be chosen for one sequence (every token masked, a logits processor failed)."""


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


def sample(
    logits: torch.Tensor, seqs: list[Sequence], vocab_limit: int | None = None
) -> list[int | SamplingError]:
    """logits [S, V] fp32 (one row per sequence) -> a token id per sequence, or the error that
    sequence hit (it fails alone; the other rows are unaffected)."""
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:
        logits[:, vocab_limit:] = float("-inf")  # padded rows of the embedding are not tokens
    tokens: list[int | SamplingError] = []
    for row, seq in zip(logits, seqs, strict=True):
        try:
            tokens.append(sample_row(row, seq))
        except Exception as exc:  # noqa: BLE001 - a processor's failure belongs to its request
            err = exc if isinstance(exc, SamplingError) else SamplingError(f"request {seq.request_id}: {exc}")
            tokens.append(err)
    return tokens


def sample_row(row: torch.Tensor, seq: Sequence) -> int:
    """logits row [V] -> the next token of `seq` under its SamplingParams."""
    p = seq.params
    for proc in p.logits_processors:
        row = proc(seq.output_token_ids, row)
    if p.temperature < MIN_TEMPERATURE:
        if not torch.isfinite(row.max()):
            raise SamplingError(f"request {seq.request_id}: no token is allowed at this step")
        return int(torch.argmax(row))
    row = apply_top_k_top_p(row / p.temperature, p.top_k, p.top_p)
    probs = torch.softmax(row, dim=-1)
    if torch.isnan(probs).any() or not probs.sum() > 0:
        raise SamplingError(f"request {seq.request_id}: no token is allowed at this step")
    return int(torch.multinomial(probs, 1, generator=seq.generator))
