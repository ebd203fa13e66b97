"""The race inside the lm_head's call (`moegate_linear_race`, kernels/bindings.py HeadRaceCall): each row's pick equals
`moegate_race_sample`'s and the numpy reference's on the logits the call wrote, bit for bit (id and score), for every
build, one and two threads, every row count, vocabulary limits, ties, infinities and NaN rows; the rows that do not
race get their first largest logit; the logits are written as by the plain call."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_cases import exact_threads
from test_kernels_race_noise import _rows

from kernels import kernel_available
from kernels.cpu_features import detect, vnni_capable
from kernels.linear import PackedLinear
from kernels.race_noise import RaceSampler, race_sample_reference

VARIANTS = ["generic", "avx2", *(["avx512"] if vnni_capable(detect()) else [])]
DRAWS = [(3, 0), (2**64 - 1, 7), (12345, 2**63 + 1)]


def _bits(x: float) -> int:
    return int(np.float32(x).view(np.uint32))


def _call(variant: str, packed: PackedLinear, x: torch.Tensor, threads: int):
    from kernels.bindings import HeadRaceCall, LinearCall
    from kernels.fused_moe import kernel_library

    out = torch.full((x.shape[0], packed.padded_out), 7.0)
    return HeadRaceCall(LinearCall(kernel_library(variant), packed, x, out, num_threads=threads)), out


def _check(variant: str, race, out: torch.Tensor, rows: int, limit: int, what) -> None:
    """Each of the first `rows` rows' pick against the references over out[m, :limit]."""
    sampler = RaceSampler(variant)
    for m in range(rows):
        logits = np.ascontiguousarray(out[m, :limit].numpy())
        t = float(race.temps[m])
        if not limit:
            want = (-1, float("-inf"))
        elif t > 0:
            want = race_sample_reference(logits, t, int(race.keys[m]), int(race.counters[m]))
            assert sampler(logits, t, int(race.keys[m]), int(race.counters[m]))[0] == want[0], (what, m)
        else:
            token = int(np.argmax(logits))
            want = (token, float(logits[token]))
        assert int(race.picks[m]) == want[0], (what, m, int(race.picks[m]), want)
        assert _bits(race.best[m]) == _bits(want[1]), (what, m, float(race.best[m]), want)


@pytest.mark.parametrize("variant", VARIANTS)
def test_race_in_head_equals_race_sample_on_the_rows_it_wrote(variant):
    """Rows of chosen logits (fp32 W [V, 1] . x = 1: out is W's column exactly): flat and near-flat rows, peaked,
    masked, ties, +inf, all -inf, and NaNs; three rows per call (two racing at different temperatures and draws, one
    taking its first largest), one and two threads, the whole row and a vocabulary limit."""
    if not kernel_available(variant):
        pytest.skip(f"no {variant} kernel build here")
    rng = np.random.default_rng(1)
    for v in (4096 * 3 + 17, 2051, 33, 5):
        kinds = _rows(rng, v)
        nan = kinds["normal"].copy()
        nan[[v // 2, v - 1]] = np.nan
        kinds["nan"] = nan
        for name, row in kinds.items():
            packed = PackedLinear.pack(torch.from_numpy(row.copy())[:, None], "fp32", None)
            for threads in (1, 2):
                race, out = _call(variant, packed, torch.ones(3, 1), threads)
                for limit in (v, v - 3 if v > 3 else v, 0):
                    for i, (temp, (key, counter)) in enumerate(zip((0.7, 0.0, 2.5), DRAWS, strict=True)):
                        race.temps[i], race.keys[i], race.counters[i] = temp, key, counter
                    race.picks[:], race.best[:] = -7, 7.0
                    with exact_threads(variant):
                        race(3, limit)
                    np.testing.assert_array_equal(out[:, :v].numpy(), np.broadcast_to(row, (3, v)))
                    _check(variant, race, out, 3, limit, (name, v, threads, limit))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("fmt,gs,n", [("fp32", None, 20_011), ("int8", 64, 4099), ("int4", 32, 1001)])
def test_race_in_head_over_projected_rows(variant, fmt, gs, n):
    """Projected rows (random x and W) of 1..16 rows, a mix of racing and greedy rows, one and two threads: the same
    picks as the references and the same logits as the plain call."""
    if not kernel_available(variant):
        pytest.skip(f"no {variant} kernel build here")
    g = torch.Generator().manual_seed(n)
    x, w = torch.randn(16, 64, generator=g), torch.randn(n, 64, generator=g) * 0.3
    packed = PackedLinear.pack(w, fmt, gs)
    rng = np.random.default_rng(n)
    for threads in (1, 2):
        race, out = _call(variant, packed, x, threads)
        plain = out.clone()
        for m in (1, 2, 5, 16):
            race.temps[:] = np.where(rng.random(16) < 0.75, rng.choice([0.3, 0.7, 1.0, 4.0], 16), 0.0)
            race.keys[:] = rng.integers(0, 2**63, 16, dtype=np.uint64)
            race.counters[:] = rng.integers(0, 1000, 16, dtype=np.uint64)
            with exact_threads(variant):
                race(m, n - m)
                race.call(m, plain)
            assert torch.equal(out[:m], plain[:m])
            _check(variant, race, out, m, n - m, (fmt, threads, m))


def test_race_in_head_checks_its_arguments():
    if not kernel_available():
        pytest.skip("no kernel build here")
    packed = PackedLinear.pack(torch.randn(40, 8), "fp32", None)
    race, _ = _call(None, packed, torch.ones(2, 8), 1)
    for rows, limit in ((0, 40), (3, 40), (1, 41), (1, -1)):
        with pytest.raises(ValueError):
            race(rows, limit)
