"""The race noise of temperature sampling: the kernel on every build this machine runs equals the numpy
reference to the bit, and the draws are Gumbel(0, 1) and independent across ids, draws and keys."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kernels import kernel_available
from kernels.cpu_features import detect, vnni_capable
from kernels.race_noise import _log, race_noise, race_noise_reference

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
