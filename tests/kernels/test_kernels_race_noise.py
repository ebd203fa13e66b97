"""The race noise of temperature sampling: the kernel on every build this machine runs equals the numpy
reference to the bit, and the draws are Gumbel(0, 1) and independent across ids, draws and keys."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kernels import kernel_available
from kernels.cpu_features import detect, vnni_capable
from kernels.race_noise import (
    NOISE_MAX,
    RaceSampler,
    _log,
    race_noise,
    race_noise_reference,
    race_sample_reference,
)

VARIANTS = ["generic", "avx2", *(["avx512"] if vnni_capable(detect()) else [])]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("n", "key", "counter"), [(151_936, 3, 0), (1, 0, 0), (37, 2**64 - 1, 2**63 + 5),
                                                   (5000, 12345, 99)])
def test_kernel_equals_reference_bits(variant, n, key, counter):
    if not kernel_available(variant):
        pytest.skip(f"no {variant} kernel build here")
    got = race_noise(n, key, counter, variant=variant).numpy()
    assert np.array_equal(got.view(np.uint32), race_noise_reference(n, key, counter).view(np.uint32))


def test_log_is_accurate_on_the_range_it_is_used():
    x = np.concatenate([np.geomspace(5.9604645e-08, 17.0, 200_001, dtype=np.float32),
                        np.float32([0.70710677, 0.70710683, 1.0, 0.5, 2.0])])
    ref = np.log(x.astype(np.float64))
    assert np.abs(_log(x) - ref).max() < 2e-6 * max(1.0, np.abs(ref).max())
    assert _log(np.float32([1.0]))[0] == 0.0


def test_draws_are_gumbel_and_independent():
    g = race_noise(400_000, 7, 1).numpy().astype(np.float64)
    assert np.isfinite(g).all()
    assert abs(g.mean() - 0.5772156649) < 0.01 and abs(g.var() - math.pi ** 2 / 6) < 0.02
    u = np.exp(-np.exp(-g))  # back to the uniforms: each decile holds a tenth
    counts = np.histogram(u, bins=10, range=(0, 1))[0]
    assert np.abs(counts / len(u) - 0.1).max() < 0.003
    other = [race_noise(400_000, 7, 2).numpy(), race_noise(400_000, 8, 1).numpy(), g[1:]]
    for h in other:  # another draw, another key, the neighbouring id: uncorrelated
        assert abs(np.corrcoef(g[:len(h)], h[:len(g)])[0, 1]) < 0.01
    assert np.array_equal(race_noise(1000, 7, 1).numpy(), g[:1000].astype(np.float32))  # a prefix of the same draw


def test_noise_max_bounds_every_draw():
    """NOISE_MAX (csrc/race_noise.h kRaceNoiseMaxBits) is g of the largest u, and no u gives more, and g never falls
    as u rises: all 2^23 of them."""
    u = ((np.arange(1 << 23, dtype=np.uint32) << np.uint32(1)) | np.uint32(1)).astype(np.float32) * np.float32(2**-24)
    g = -_log(-_log(u))
    assert g.max() == NOISE_MAX == g[-1]
    assert (np.diff(g) >= 0).all()  # g rises with u: a bucket of u's largest g bounds every draw in it (race_chunk)


def _rows(rng: np.random.Generator, v: int) -> dict[str, np.ndarray]:
    peaked = rng.standard_normal(v).astype(np.float32) * 4
    peaked[rng.integers(v, size=3)] += 30
    masked = peaked.copy()
    masked[rng.random(v) < 0.9] = -np.inf
    one_left = np.full(v, -np.inf, dtype=np.float32)
    one_left[v // 3] = 0.0
    ties = np.zeros(v, dtype=np.float32)
    ties[::7] = 1.0
    return {
        "flat": np.zeros(v, dtype=np.float32),
        "near_flat": (rng.standard_normal(v) * 0.01).astype(np.float32),
        "normal": rng.standard_normal(v).astype(np.float32),
        "peaked": peaked, "masked": masked, "one_left": one_left, "ties": ties,
        "all_masked": np.full(v, -np.inf, dtype=np.float32),
        "plus_inf": np.where(np.arange(v) % 1000 == 5, np.inf, peaked).astype(np.float32),
    }


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.05, 3.0])
def test_race_sample_equals_the_full_draw(variant, temperature):
    """The pruned race in one call picks the full draw's id with its score, bit for bit, for peaked and flat rows,
    masked rows, ties and infinities, at sizes around the kernel's blocks and chunks."""
    if not kernel_available(variant):
        pytest.skip(f"no {variant} kernel build here")
    rng = np.random.default_rng(int(temperature * 100))
    for v in (151_936, 4096 * 3 + 17, 33, 16, 5, 1):
        for name, row in _rows(rng, v).items():
            for key, counter in ((3, 0), (2**64 - 1, 7), (12345, 2**63 + 1)):
                want = race_sample_reference(row, temperature, key, counter)
                got = RaceSampler(variant)(row, temperature, key, counter)
                assert got[0] == want[0], (name, v, key, counter)
                assert np.float32(got[1]).view(np.uint32) == np.float32(want[1]).view(np.uint32), (name, v)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_race_sample_nan_and_threads(threads):
    rng = np.random.default_rng(0)
    row = rng.standard_normal(151_936).astype(np.float32)
    want = race_sample_reference(row, 1.0, 9, 4)
    assert RaceSampler(threads=threads)(row, 1.0, 9, 4) == want
    row[[70_000, 90_000]] = np.nan
    token, score = RaceSampler(threads=threads)(row, 1.0, 9, 4)
    assert (token, math.isnan(score)) == (70_000, True) == (race_sample_reference(row, 1.0, 9, 4)[0], True)
