"""Sampler: greedy, temperature, top-k, top-p, seeds, logits processors."""

from __future__ import annotations

import pytest
import torch

from engine.sampler import SamplingError, apply_top_k_top_p, race_noise, sample, sample_row
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


def test_plain_greedy_rows_choose_what_the_masked_row_chooses():
    """Greedy rows with no logits processor read their token from the logits in place, up to the vocabulary
    limit: the same id, or the same failure, as `sample_row` on the vocabulary-masked row, and the logits are
    left as they were."""
    rows = torch.randn(7, 40, generator=torch.Generator().manual_seed(0))
    rows[1, 33] = 50.0  # the largest logit is a padded id: never chosen
    rows[2] = float("-inf")
    rows[2, 35] = 1.0  # only a padded id is finite: no token
    rows[3, 4] = rows[3, 9] = 9.0  # a tie: the lower id
    rows[4, 7] = float("nan")
    rows[5, 30] = float("inf")
    rows[6, :32] = float("-inf")
    limit, seqs = 32, [_seq() for _ in range(7)]
    got = sample(rows.clone(), seqs, vocab_limit=limit)
    masked = rows.clone()
    masked[:, limit:] = float("-inf")
    for row, seq, token in zip(masked, seqs, got, strict=True):
        try:
            want = sample_row(row, seq)
        except SamplingError as e:
            assert isinstance(token, SamplingError) and str(token) == str(e)
        else:
            assert token == want
    assert got[1] != 33 and got[3] == 4
    kept = rows.clone()
    sample(kept, seqs, vocab_limit=limit)
    assert torch.equal(kept.nan_to_num(), rows.nan_to_num())


def test_plain_greedy_rows_beside_other_rows_choose_as_alone():
    """A batch mixing plain greedy rows with processor and seeded temperature rows: each row's token is the one it
    gets alone (the other rows still see the vocabulary mask)."""
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    logits[:, 60:] = 100.0  # padded ids

    def no_even(generated, row):
        return row.index_fill(0, torch.arange(0, row.shape[0], 2), float("-inf"))

    def seqs():
        return [_seq(), _seq(logits_processors=[no_even]), _seq(temperature=0.8, seed=3), _seq()]

    together = sample(logits.clone(), seqs(), vocab_limit=60)
    alone = [sample(logits[i:i + 1].clone(), [s], vocab_limit=60)[0] for i, s in enumerate(seqs())]
    assert together == alone and all(t < 60 for t in together) and together[1] % 2 == 1


@pytest.mark.parametrize("shape", ["peaked", "flat", "masked"])
def test_kernel_race_picks_the_full_draws_token(shape):
    """A plain temperature row's race in one kernel call (noise drawn only where it can win) gives the token of the
    full draw scored in numpy (the path a row with its noise already drawn takes), step after step, and uses up one
    draw per step either way."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(40, 151_936, generator=gen) * (6.0 if shape == "peaked" else 0.01)
    if shape == "masked":
        logits[:, torch.rand(151_936, generator=gen) < 0.95] = float("-inf")
    kernel, full = _seq(temperature=0.9, seed=11), _seq(temperature=0.9, seed=11)
    for row in logits:
        noise = race_noise(row.shape[0], full)
        assert sample_row(row.clone(), kernel) == sample_row(row.clone(), full, noise=noise)
    assert kernel.noise_draws == full.noise_draws == 40
    with pytest.raises(SamplingError):
        sample_row(torch.full((1000,), float("-inf")), kernel)
    with pytest.raises(SamplingError):
        sample_row(torch.tensor([0.0, float("nan"), 1.0]), kernel)


def test_plain_temperature_rows_in_place_equal_the_masked_rows():
    """`sample` takes plain temperature rows (no processor, no top-k / top-p) in place, limited to `vocab_limit`
    without writing the mask: the tokens of `sample_row` on the masked rows with the same seeds, a row whose limited
    ids are all -inf fails alone, and greedy and top-k rows beside them keep their paths."""
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(5, 3000, generator=gen) * 3
    logits[3, :2900] = float("-inf")  # nothing below the limit: fails
    kinds = [dict(temperature=1.0, seed=1), dict(temperature=0.6, seed=2), dict(), dict(temperature=1.3, seed=3),
             dict(temperature=0.8, seed=4, top_k=50)]
    got = sample(logits.clone(), [_seq(**k) for k in kinds], vocab_limit=2900)
    masked = logits.clone()
    masked[:, 2900:] = float("-inf")
    for i, k in enumerate(kinds):
        if i == 3:
            assert isinstance(got[i], SamplingError)
            continue
        assert got[i] == sample_row(masked[i].clone(), _seq(**k)), k
