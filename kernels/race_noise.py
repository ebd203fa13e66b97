"""The race noise of temperature sampling (engine/sampler.py) through the compiled kernel
(csrc/race_noise.h), with the numpy reference that gives the same bits.

One draw is g_i = -log(-log u_i) (Gumbel noise: -log of an Exp(1) variate) for ids i = 0..n-1, u_i uniform in
(0, 1) from a counter-based hash of (key, counter, i): a sequence's k-th draw is a function of its key and k
alone, whatever else runs in the step. The kernel is a plain loop of single IEEE operations, so every SIMD build
and the reference agree to the bit; a 152k vocabulary costs ~0.6 ms (avx512) to ~1.1 ms (avx2) on a shared
2-core Xeon, where torch's `exponential_` took ~4 ms (a serial draw per id).

`race_sample`: a row's whole race (the scores logits / T + noise and their first largest) in one kernel call over the
kernel's pool, drawing the noise only of ids that can still win (a draw's noise is bounded: `NOISE_MAX`); the same id
as `race_sample_reference`, the full draw in numpy."""

from __future__ import annotations

import ctypes

import numpy as np
import torch

_M64 = (1 << 64) - 1
_F = np.float32
NOISE_MAX = np.uint32(0x41851592).view(np.float32)  # 16.635532: the largest g a draw gives (its largest u's)


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _fmix32(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def _log(x: np.ndarray) -> np.ndarray:
    """Cephes logf for normal x > 0, one float32 operation per step as csrc/race_noise.h's race_log."""
    bits = x.view(np.uint32)
    e = ((bits >> np.uint32(23)) & np.uint32(0xFF)).astype(np.int32) - 126
    m = ((bits & np.uint32(0x807FFFFF)) | np.uint32(0x3F000000)).view(np.float32)
    low = m < _F(0.707106781186547524)
    e = np.where(low, e - 1, e)
    m = np.where(low, (m + m) - _F(1), m - _F(1))
    z = m * m
    y = np.full_like(m, _F(7.0376836292e-2))
    for c in (-1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1, 1.4249322787e-1, -1.6668057665e-1,
              2.0000714765e-1, -2.4999993993e-1, 3.3333331174e-1):
        y = y * m + _F(c)  # (the kernel's `y * m - c` for c < 0: the same IEEE result)
    y = (y * m) * z
    fe = e.astype(np.float32)
    y = y + fe * _F(-2.12194440e-4)
    y = y - z * _F(0.5)
    return (m + y) + fe * _F(0.693359375)


def race_noise_reference(n: int, key: int, counter: int) -> np.ndarray:
    """[n] float32: draw number `counter` of the stream `key` (both taken mod 2^64)."""
    k = _splitmix64((key & _M64) ^ _splitmix64(counter & _M64))
    k0, k1 = np.uint32(k & 0xFFFFFFFF), np.uint32(k >> 32)
    i = np.arange(n, dtype=np.uint32)
    h = _fmix32(_fmix32((i * np.uint32(0x9E3779B9)) ^ k0) ^ k1)
    u = (((h >> np.uint32(9)) << np.uint32(1)) | np.uint32(1)).astype(np.float32) * _F(5.9604644775390625e-8)
    return -_log(-_log(u))


def race_noise(n: int, key: int, counter: int, variant: str | None = None) -> torch.Tensor:
    """[n] float32 on the CPU: `race_noise_reference`'s bits, through the kernel (the machine's build, or
    `variant`) where it is available."""
    from kernels.fused_moe import kernel_library

    lib = kernel_library(variant)
    if lib is None or not hasattr(lib, "moegate_race_noise"):
        return torch.from_numpy(race_noise_reference(n, key, counter))
    out = torch.empty(n)
    lib.moegate_race_noise(out.data_ptr(), n, key & _M64, counter & _M64)
    return out


def race_sample_reference(logits: np.ndarray, temperature: float, key: int, counter: int) -> tuple[int, float]:
    """(id, score) of the race over logits [V] fp32: numpy's first largest of logits / T + the full draw (a NaN
    logit: the first NaN's id, its score NaN)."""
    scores = np.divide(logits, np.float32(temperature))
    scores += race_noise_reference(logits.shape[0], key, counter)
    token = int(np.argmax(scores))
    return token, float(scores[token])


class RaceSampler:
    """`race_sample` through one kernel build (a decode step calls it per row). `threads`: the kernel pool's threads
    for one row's chunks of ids; 1 by default: on a shared 2-vCPU Xeon at load ~9 a second thread made a row whose
    every block is drawn 4-13x slower (median of 200, 4.4-13.2 ms against 0.93-0.98 alone: the caller waits for a
    descheduled helper's chunk), and on a row that prunes to a few blocks there is little left to share."""

    def __init__(self, variant: str | None = None, threads: int = 1) -> None:
        from kernels.fused_moe import kernel_library

        lib = kernel_library(variant)
        self._call = getattr(lib, "moegate_race_sample", None) if lib is not None else None
        self.threads = threads

    def __call__(self, logits: np.ndarray, temperature: float, key: int, counter: int) -> tuple[int, float]:
        """(id, score) for logits [V] fp32 contiguous: `race_sample_reference`'s."""
        if self._call is None or logits.dtype != np.float32 or not logits.flags.c_contiguous:
            return race_sample_reference(logits, temperature, key, counter)
        best = ctypes.c_float()
        token = self._call(logits.ctypes.data, logits.shape[0], temperature, key & _M64, counter & _M64,
                           ctypes.addressof(best), self.threads)
        return token, best.value


_samplers: dict[str | None, RaceSampler] = {}


def race_sample(logits: np.ndarray, temperature: float, key: int, counter: int,
                variant: str | None = None) -> tuple[int, float]:
    """(id, score): the first largest of fl(fl(logits / T) + noise) over logits [V] fp32 contiguous, noise being
    draw `counter` of the stream `key` (`race_noise`), through the kernel (the machine's build, or `variant`) where
    it is available; `race_sample_reference`'s id and score bit for bit."""
    if (sampler := _samplers.get(variant)) is None:
        sampler = _samplers[variant] = RaceSampler(variant)
    return sampler(logits, temperature, key, counter)
