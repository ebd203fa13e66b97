"""CPU feature detection (from /proc/cpuinfo) and the kernel variant it selects."""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass

_FLAG_NAMES = {"avx2": "avx2", "fma": "fma", "f16c": "f16c", "avx512f": "avx512f", "avx512bw": "avx512bw",
               "avx512vl": "avx512vl", "avx512_vnni": "avx512_vnni", "avx512_bf16": "avx512_bf16",
               "amx": "amx_tile"}


@dataclass(frozen=True)
class CpuFeatures:
    arch: str
    avx2: bool = False
    fma: bool = False
    f16c: bool = False
    avx512f: bool = False
    avx512bw: bool = False
    avx512vl: bool = False
    avx512_vnni: bool = False
    avx512_bf16: bool = False
    amx: bool = False

    @classmethod
    def from_flags(cls, arch: str, flags: set[str]) -> CpuFeatures:
        return cls(arch, **{field: flag in flags for field, flag in _FLAG_NAMES.items()})

    def summary(self) -> str:
        have = [f for f in _FLAG_NAMES if getattr(self, f)]
        return f"{self.arch} [{' '.join(have) or 'baseline'}]"


@functools.cache
def detect() -> CpuFeatures:
    """Features of this machine; baseline (no SIMD extensions assumed) if /proc/cpuinfo is unreadable."""
    arch = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return CpuFeatures.from_flags(arch, set(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return CpuFeatures(arch)


def select_variant(features: CpuFeatures) -> str:
    """Kernel variant for these features: "avx2" (AVX2 + FMA + F16C, x86-64) or "generic".

    The "avx512" build (AVX-512 VNNI vpdpbusd for the W4A8 dot products; bitwise the same results) is
    opt-in with MOEGATE_KERNEL_VARIANT=avx512 where `vnni_capable` holds: on the AMD EPYC (Zen 4) it was
    measured on, it is no faster than avx2 at M = 8 and ~15% slower at M = 1.
    """
    x86 = features.arch in ("x86_64", "AMD64", "i686")
    if not (x86 and features.avx2 and features.fma and features.f16c):
        return "generic"
    return "avx2"


def vnni_capable(features: CpuFeatures) -> bool:
    """Whether the avx512 kernel variant can run here (AVX2 baseline plus AVX-512 F/BW/VL/VNNI)."""
    return (select_variant(features) == "avx2" and features.avx512f and features.avx512bw and features.avx512vl
            and features.avx512_vnni)
