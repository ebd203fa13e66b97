"""The plain temperature rows' races in the fused decode step's lm_head call (engine/models/fused_step.py `_races`,
kernels/bindings.py HeadRaceCall) and the sampler's use of them (engine/sampler.py HeadPicks): the same tokens as the
sampler's own race over the logits, batched with greedy, top-k and logits-processor rows, in both profiles, over the
whole row and under a vocabulary limit; a pick whose draw or limit is not the row's own is not taken."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kernels.race_noise as race_noise
from engine.models.fused_step import FusedDecodeStep
from engine.sampler import HeadPicks, sample
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from kernels.race_noise import race_sample_reference
from tests.engine.conftest import run_requests
from tests.engine.test_engine_fused_step import _prompt, engine, picks_per_run  # noqa: F401 - the module's engine fixture


def _requests(mode: str, tag: str) -> list:
    """Five requests (batches of 5 down to 1 decodes): seeded temperature rows, one with top-k, a greedy row and a
    temperature row with a logits processor."""
    def forbid_seven(generated, row):
        return row.index_fill(0, torch.tensor([7]), float("-inf"))

    params = [SamplingParams(max_tokens=9, ignore_eos=True, temperature=0.8, seed=1),
              SamplingParams(max_tokens=6, ignore_eos=True),
              SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.3, seed=2),
              SamplingParams(max_tokens=7, ignore_eos=True, temperature=0.9, seed=3, top_k=20),
              SamplingParams(max_tokens=5, ignore_eos=True, temperature=0.7, seed=4, logits_processors=[forbid_seven])]
    return [(f"{tag}-{i}", _prompt(5 + 7 * i, i), p, mode) for i, p in enumerate(params)]


@pytest.mark.parametrize("mode", ["exploration", "execution"])
@pytest.mark.parametrize("limit", [None, 300])
def test_tokens_equal_with_the_race_in_the_head_off(engine, mode, limit, monkeypatch):  # noqa: F811
    runner = engine.runner
    raced = picks_per_run(monkeypatch, runner, lambda first_max: isinstance(first_max, HeadPicks))
    monkeypatch.setattr(engine, "vocab_limit", limit)
    monkeypatch.setattr(runner, "vocab_limit", limit)
    taken = []
    own = race_noise.race_sample
    monkeypatch.setattr(race_noise, "race_sample", lambda *a, **kw: taken.append(1) or own(*a, **kw))
    on = run_requests(engine, _requests(mode, "race-on"))
    calls_on = len(taken)
    assert any(raced)
    raced.clear()
    taken.clear()
    with monkeypatch.context() as m:
        m.setattr(FusedDecodeStep, "pick_in_kernel", False)
        off = run_requests(engine, _requests(mode, "race-off"))
    assert not any(raced)
    assert [on[f"race-on-{i}"] for i in range(5)] == [off[f"race-off-{i}"] for i in range(5)]
    assert calls_on < len(taken)  # the plain rows' decode races ran in the head instead


def test_sampler_takes_a_head_pick_only_for_the_rows_own_draw_and_limit():
    rng = np.random.default_rng(0)
    logits = torch.from_numpy(rng.standard_normal((3, 50)).astype(np.float32))
    seqs = [Sequence(f"r{i}", [1], SamplingParams(temperature=0.7, seed=i)) for i in range(3)]
    for i, s in enumerate(seqs):
        s.noise_key, s.noise_draws = 100 + i, 4
    want = [race_sample_reference(logits[i].numpy(), 0.7, seqs[i].noise_key, 4)[0] for i in range(3)]
    fake = np.array([(w + 1) % 50 for w in want], dtype=np.int64)  # picks the references would not make
    draws = [(seqs[0].noise_key, 4), (seqs[1].noise_key, 5), None]  # row 1: a stale draw; row 2: not raced
    got = sample(logits, seqs, None, HeadPicks(fake, np.zeros(3, np.float32), draws, 50))
    assert got == [int(fake[0]), want[1], want[2]]
    assert [s.noise_draws for s in seqs] == [5, 5, 5]  # each row's draw used up once
    for s in seqs:
        s.noise_draws = 4
    assert sample(logits, seqs, None, HeadPicks(fake, np.zeros(3, np.float32), draws, 49)) == want  # another limit
    for s in seqs:
        s.noise_draws = 4
    inf = HeadPicks(fake, np.full(3, -np.inf, np.float32), draws, 50)
    assert isinstance(sample(logits, seqs, None, inf)[0], Exception)  # the head's non-finite best fails the row
