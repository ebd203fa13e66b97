"""The plain temperature rows' races in the fused decode step's lm_head call (engine/models/fused_step.py `_races`,
kernels/bindings.py HeadRaceCall) and the sampler's use of them (engine/sampler.py HeadPicks, `head_picks`): the same
tokens as the sampler's own race over the logits, batched with greedy, top-k and logits-processor rows, in both
profiles, over the whole row and under a vocabulary limit; a pick whose draw or limit is not the row's own is not
taken."""

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


def test_kernel_picks_take_the_head_races_whole_or_not_at_all():
    """`kernel_picks` over a HeadPicks (engine/sampler.py `head_picks`): every row plain greedy or raced with its
    own next draw and the limit: the head's tokens, each raced row's draw used up once, as `sample` takes them; any
    row that `sample` must decide (a stale draw, another limit, a non-finite best, a pick past the limit, a top-k
    row): None and no draw used."""
    from engine.sampler import LogitsView, kernel_picks

    rng = np.random.default_rng(1)
    logits = torch.from_numpy(rng.standard_normal((3, 50)).astype(np.float32))
    params = [SamplingParams(temperature=0.7, seed=0), SamplingParams(), SamplingParams(temperature=1.1, seed=2)]
    seqs = [Sequence(f"k{i}", [1], p) for i, p in enumerate(params)]
    for i, s in enumerate(seqs):
        s.noise_key, s.noise_draws = 200 + i, 3
    tokens = np.array([race_sample_reference(logits[0].numpy(), 0.7, 200, 3)[0], int(logits[1].argmax()),
                       race_sample_reference(logits[2].numpy(), 1.1, 202, 3)[0]], dtype=np.int64)
    draws, zeros = [(200, 3), None, (202, 3)], np.zeros(3, np.float32)

    def picks(tokens=tokens, best=zeros, draws=draws, limit=50, seqs=seqs):
        return kernel_picks(LogitsView(logits), seqs, None, HeadPicks(tokens, best, draws, limit))

    assert picks() == [[int(t)] for t in tokens]
    assert [s.noise_draws for s in seqs] == [4, 3, 4]  # the raced rows' draws used up, the greedy row's not
    for s in seqs:
        s.noise_draws = 3
    assert sample(logits, seqs, None, HeadPicks(tokens, zeros, draws, 50)) == tokens.tolist()
    for s in seqs:
        s.noise_draws = 3
    stale, wide = [(200, 3), None, (202, 2)], np.array([tokens[0], 50, tokens[2]], dtype=np.int64)
    top_k = [*seqs[:2], Sequence("k3", [1], SamplingParams(temperature=1.1, seed=2, top_k=5))]
    top_k[2].noise_key, top_k[2].noise_draws = 202, 3
    for kw in ({"draws": stale}, {"limit": 49}, {"best": np.array([0, 0, np.inf], np.float32)}, {"tokens": wide},
               {"seqs": top_k}):
        assert picks(**kw) is None, kw
        assert [s.noise_draws for s in (*seqs, top_k[2])] == [3, 3, 3, 3]
