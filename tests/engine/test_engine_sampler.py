"""Sampler: greedy, temperature, top-k, top-p, seeds, logits processors."""

from __future__ import annotations

import pytest
import torch

from engine.sampler import SamplingError, apply_top_k_top_p, sample
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


def _seq(**kw) -> Sequence:
    return Sequence("r", [1], SamplingParams(**kw))


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    assert torch.isfinite(apply_top_k_top_p(logits, 2, 1.0)).tolist() == [True, True, False, False, False]
    # nucleus 0.6: 0.5 alone is below 0.6, so the token that crosses it (0.2) is kept too
    assert torch.isfinite(apply_top_k_top_p(logits, 0, 0.6)).tolist() == [True, True, False, False, False]
    assert torch.isfinite(apply_top_k_top_p(logits, 0, 0.5)).tolist() == [True, False, False, False, False]


def test_greedy_and_processor_hook():
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0]])
    assert sample(logits.clone(), [_seq()]) == [1]

    def forbid_one(generated, row):
        return row.index_fill(0, torch.tensor([1]), float("-inf"))

    assert sample(logits.clone(), [_seq(logits_processors=[forbid_one])]) == [3]
    assert sample(logits.clone(), [_seq()], vocab_limit=1) == [0]  # padded vocabulary never sampled


def test_seeded_sampling_is_reproducible_and_temperature_matters():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    draws = lambda seed: [sample(logits.clone(), [s])[0] for s in [_seq(temperature=1.0, seed=seed)] for _ in range(20)]  # noqa: E731
    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    cold = {sample(logits.clone(), [_seq(temperature=0.01, seed=i)])[0] for i in range(10)}
    assert cold == {int(logits.argmax())}


def test_a_failing_row_fails_alone():
    def none(generated, row):
        return torch.full_like(row, float("-inf"))

    def broken(generated, row):
        raise ValueError("constraint state corrupted")

    out = sample(torch.zeros(4, 4), [_seq(logits_processors=[none]), _seq(), _seq(logits_processors=[broken]),
                                     _seq(temperature=1e-30, top_p=5e-324)])
    assert isinstance(out[0], SamplingError) and "no token is allowed" in str(out[0])
    assert out[1] == 0 and out[3] == 0  # a vanishing temperature samples like greedy
    assert isinstance(out[2], SamplingError) and "constraint state corrupted" in str(out[2])


def test_invalid_params_are_rejected():
    for kw in ({"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"top_k": -2}):
        with pytest.raises(ValueError):
            SamplingParams(**kw)
