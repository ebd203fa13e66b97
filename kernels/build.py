"""Build (once, cached on disk) and load the compiled CPU MoE kernel as a plain shared library.

The kernel has no torch headers: it is compiled with the system C++ compiler in a few seconds and
called through ctypes with raw pointers. Builds are cached under ``$MOEGATE_KERNEL_CACHE`` (default
``~/.cache/moegate/kernels``) keyed by a hash of the source, flags and compiler version; a failed
build or missing compiler returns None and the caller falls back to the torch reference.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "moe_cpu.cpp"
_COMMON_FLAGS = ["-O3", "-std=c++17", "-pthread", "-fopenmp", "-ffp-contract=off", "-fPIC", "-shared"]
VARIANT_FLAGS = {
    "avx512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "generic": [],
}
_P = ctypes.c_void_p
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}
_MISSING = object()


class DecodeLayerParams(ctypes.Structure):
    """Mirror of struct DecodeLayerParams in kernels/csrc/decode_layer.h."""

    _fields_ = [(n, ctypes.c_int64) for n in ("H", "NH", "KV", "D", "E", "topk", "I", "norm_topk", "qk_norm",
                                              "window")] + [
        ("eps", ctypes.c_double), ("scale", ctypes.c_double),
        ("ln1", _P), ("ln2", _P), ("qn", _P), ("kn", _P),
        ("dense_fmt", ctypes.c_int64), ("dense_gs", ctypes.c_int64),
        ("qkv_w", _P), ("qkv_s", _P), ("qkv_m", _P), ("o_w", _P), ("o_s", _P), ("o_m", _P),
        ("router", _P), ("exp_fmt", ctypes.c_int64), ("exp_gs", ctypes.c_int64),
        ("gu_w", _P), ("gu_s", _P), ("gu_m", _P), ("dn_w", _P), ("dn_s", _P), ("dn_m", _P),
    ]


class DecodeStepArgs(ctypes.Structure):
    """Mirror of struct DecodeStepArgs in kernels/csrc/moe_cpu.cpp: `moegate_decode_step`'s kept arguments (the
    stack's, then the lm_head's, then its races' buffers; pointers as addresses)."""

    _fields_ = [(n, _P) for n in ("layers",)] + [("L", ctypes.c_int64)] + [
        (n, _P) for n in ("x", "cos", "sin", "k_caches", "v_caches", "slot_mapping", "ctx_slots", "ctx_start", "ctx_len",
                          "topk_ids", "counts", "norm_w")] + [("norm_eps", ctypes.c_double), ("norm_out", _P)] + [
        (n, ctypes.c_int64) for n in ("nthreads", "cache_slots", "ctx_total")] + [("logits", _P)] + [
        (n, ctypes.c_int64) for n in ("N", "K", "fmt", "gs")] + [(n, _P) for n in ("w", "s", "mins")] + [
        ("head_threads", ctypes.c_int64), ("first_max", _P)] + [
        (n, _P) for n in ("temps", "keys", "counters", "picks", "best")]


class KernelBuildError(RuntimeError):
    """The C++ kernel could not be compiled or loaded."""


def cache_dir() -> Path:
    root = os.environ.get("MOEGATE_KERNEL_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "moegate" / "kernels"


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")


def _build_key(cxx: str, flags: list[str], source: Path) -> str:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    h = hashlib.sha256()
    for path in [source, *sorted(source.parent.glob("*.h"))]:  # the source and its headers
        h.update(path.read_bytes())
    h.update("\0".join([*flags, version]).encode())
    return h.hexdigest()[:16]


def build(variant: str, source: Path | None = None) -> Path:
    """Compile ``variant`` of ``source`` (default: this package's kernel) if no cached build exists; return
    the shared library path. Another source (an earlier revision's csrc) lets a benchmark run the old
    kernel beside the new one in one process."""
    source = SOURCE if source is None else Path(source)
    if variant not in VARIANT_FLAGS:
        raise KernelBuildError(f"unknown kernel variant {variant!r}; choose from {sorted(VARIANT_FLAGS)}")
    cxx = _compiler()
    if cxx is None:
        raise KernelBuildError("no C++ compiler found (set CXX or install g++)")
    flags = _COMMON_FLAGS + VARIANT_FLAGS[variant]
    name = f"moe_cpu-{variant}-{_build_key(cxx, flags, source)}.so"
    out = cache_dir() / name
    if out.exists():
        _touch(out)
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError:  # read-only home (containers): build under the temp dir instead
        out = Path(tempfile.gettempdir()) / "moegate-kernels" / name
        if out.exists():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        proc = subprocess.run([cxx, *flags, "-o", tmp, str(source)], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise KernelBuildError(f"{cxx} failed for the {variant} kernel:\n{proc.stderr[-2000:]}")
        os.replace(tmp, out)  # atomic: concurrent builders leave one complete file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    prune(out.parent, variant)
    return out


STALE_S = 7 * 24 * 3600  # a build unused this long (other sources, older compilers) is deleted


def _touch(path: Path) -> None:
    with contextlib.suppress(OSError):  # a read-only cache: the build is still used, only not marked
        os.utime(path)  # marks the build as in use, so prune() leaves it alone


def prune(directory: Path, variant: str, stale_s: float = STALE_S) -> list[Path]:
    """Deletes this variant's cached builds not used for `stale_s` (each use refreshes a build's mtime, so a
    library another process is about to open is never the one deleted). Returns what was deleted."""
    import time

    gone = []
    for old in directory.glob(f"moe_cpu-{variant}-*.so"):
        try:
            if time.time() - old.stat().st_mtime > stale_s:
                old.unlink()
                gone.append(old)
        except OSError:
            continue
    return gone


_FALLBACK = {"avx512": "avx2"}  # a variant whose build fails -> the one to use instead (same results)


# Run-time path levels of the avx512 build (kernels/csrc/paths.h): the widest one a kernel may use.
PATH_LEVELS = {"amx": 2, "bf16": 1, "zmm": 0}


def path_level_from_env() -> int | None:
    """$MOEGATE_PATH_LIMIT (amx | bf16 | zmm) as a level, or None where it is unset."""
    name = os.environ.get("MOEGATE_PATH_LIMIT", "").strip().lower()
    if not name:
        return None
    if name not in PATH_LEVELS:
        raise KernelBuildError(f"MOEGATE_PATH_LIMIT={name!r}: choose from {', '.join(PATH_LEVELS)}")
    return PATH_LEVELS[name]


def _open(variant: str, source: Path | None = None) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build(variant) if source is None else build(variant, source)))
    _declare(lib)
    level = path_level_from_env()
    if level is not None and hasattr(lib, "moegate_path_limit"):
        lib.moegate_path_limit(level)
    return lib


def load_source(variant: str, source: Path) -> ctypes.CDLL:
    """``variant`` of another kernel source, built and loaded (raises KernelBuildError): benchmarks only."""
    return _open(variant, source)


def loaded() -> list[ctypes.CDLL]:
    """The kernel libraries loaded so far (one per variant)."""
    return [lib for lib in list(_loaded.values()) if lib is not None]


def load(variant: str) -> ctypes.CDLL | None:
    """The loaded kernel library for ``variant``, or None (with one logged warning) if it cannot be built.

    An avx512 build that fails (a compiler without AVX-512 VNNI support) falls back to the avx2 build."""
    lib = _loaded.get(variant, _MISSING)  # loaded (or failed) already: no lock for the per-call lookup
    if lib is not _MISSING:
        return lib
    with _lock:
        if variant in _loaded:
            return _loaded[variant]
        lib: ctypes.CDLL | None = None
        try:
            lib = _open(variant)
        except (KernelBuildError, OSError) as exc:
            fallback = _FALLBACK.get(variant)
            if fallback is not None:
                with contextlib.suppress(KernelBuildError, OSError):
                    lib = _open(fallback)
            instead = "the torch reference" if lib is None else f"the {fallback} build"
            log.warning("moegate CPU MoE kernel (%s) unavailable, using %s: %s", variant, instead, exc)
        _loaded[variant] = lib
        return lib


def _declare(lib: ctypes.CDLL) -> None:
    """Every C entry point's ctypes signature: the one place they are declared (kernels/bindings.py calls
    them for code outside kernels/)."""
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.moegate_fused_moe.restype = ctypes.c_int
    lib.moegate_fused_moe.argtypes = [p, p, p, p, i64, i64, i64, i64, i64, i64, i64,
                                      p, p, p, p, p, p, ctypes.c_int, p, p, ctypes.c_int, ctypes.c_float,
                                      ctypes.c_float]
    lib.moegate_linear.restype = ctypes.c_int
    lib.moegate_linear.argtypes = [p, p, i64, i64, i64, i64, i64, p, p, p, ctypes.c_int]
    if hasattr(lib, "moegate_linear_first_max"):  # absent from an earlier revision's kernel (benchmarks)
        lib.moegate_linear_first_max.restype = ctypes.c_int
        lib.moegate_linear_first_max.argtypes = [p, p, i64, i64, i64, i64, i64, p, p, p, ctypes.c_int, p]
    if hasattr(lib, "moegate_linear_race"):
        lib.moegate_linear_race.restype = ctypes.c_int
        lib.moegate_linear_race.argtypes = [p, p, i64, i64, i64, i64, i64, p, p, p, ctypes.c_int, i64, p, p, p, p, p]
    if hasattr(lib, "moegate_rms_norm"):  # absent from an earlier revision's kernel (benchmarks)
        lib.moegate_rms_norm.restype = ctypes.c_int
        lib.moegate_rms_norm.argtypes = [p, p, p, i64, i64, ctypes.c_double]
    if hasattr(lib, "moegate_add_rms_norm"):
        lib.moegate_add_rms_norm.restype = ctypes.c_int
        lib.moegate_add_rms_norm.argtypes = [p, p, p, p, p, i64, i64, ctypes.c_double, ctypes.c_int]
        lib.moegate_rms_norm_heads.restype = ctypes.c_int
        lib.moegate_rms_norm_heads.argtypes = [p, i64, i64, p, p, i64, i64, i64, ctypes.c_double, ctypes.c_int]
    if hasattr(lib, "moegate_rope"):
        lib.moegate_rope.restype = ctypes.c_int
        lib.moegate_rope.argtypes = [p, p, p, p, i64, i64, i64, i64, i64, ctypes.c_int]
    if hasattr(lib, "moegate_attention"):
        lib.moegate_attention.restype = ctypes.c_int
        lib.moegate_attention.argtypes = [p, i64, i64, p, p, p, p, p, i64, i64, i64, i64, i64, ctypes.c_double, p,
                                          ctypes.c_int]
    if hasattr(lib, "moegate_router"):
        lib.moegate_router.restype = ctypes.c_int
        lib.moegate_router.argtypes = [p, p, p, i64, i64, i64, i64, i64, i64, p, p, p, ctypes.c_int]
    lib.moegate_is_avx2.restype = ctypes.c_int
    lib.moegate_is_vnni.restype = ctypes.c_int
    if hasattr(lib, "moegate_simd_path"):  # absent from an earlier revision's kernel (benchmarks)
        lib.moegate_simd_path.restype = ctypes.c_char_p
        lib.moegate_has_bf16_dot.restype = ctypes.c_int
    if hasattr(lib, "moegate_path_limit"):
        lib.moegate_path_limit.restype = ctypes.c_int
        lib.moegate_path_limit.argtypes = [ctypes.c_int]
        lib.moegate_has_amx.restype = ctypes.c_int
    lib.moegate_apply_bitmask.restype = ctypes.c_int
    lib.moegate_apply_bitmask.argtypes = [p, p, i64, i64, i64, i64]
    if hasattr(lib, "moegate_race_noise"):  # absent from an earlier revision's kernel (benchmarks)
        lib.moegate_race_noise.restype = ctypes.c_int
        lib.moegate_race_noise.argtypes = [p, i64, ctypes.c_uint64, ctypes.c_uint64]
    if hasattr(lib, "moegate_race_sample"):
        lib.moegate_race_sample.restype = i64
        lib.moegate_race_sample.argtypes = [p, i64, ctypes.c_float, ctypes.c_uint64, ctypes.c_uint64, p, ctypes.c_int]
    if hasattr(lib, "moegate_pool_sizing"):  # absent from an earlier revision's kernel (benchmarks)
        lib.moegate_pool_sizing.restype = ctypes.c_int
        lib.moegate_pool_sizing.argtypes = [ctypes.c_int]
    if hasattr(lib, "moegate_pool_spin"):
        lib.moegate_pool_spin.restype = ctypes.c_int64
        lib.moegate_pool_spin.argtypes = [ctypes.c_int64]
        lib.moegate_pool_rest.restype = None
        lib.moegate_pool_rest.argtypes = []
    lib.moegate_stream_triad.restype = ctypes.c_double
    lib.moegate_stream_triad.argtypes = [p, p, p, i64, ctypes.c_int, ctypes.c_int]
    if hasattr(lib, "moegate_decode_layer"):  # absent from an earlier revision's kernel (benchmarks)
        lib.moegate_decode_layer.restype = ctypes.c_int
        lib.moegate_decode_layer.argtypes = [ctypes.POINTER(DecodeLayerParams), p, i64, p, p, p, p, p, p, p, p, p,
                                             ctypes.c_int, i64, i64]
    if hasattr(lib, "moegate_decode_stack"):
        lib.moegate_decode_stack.restype = ctypes.c_int
        lib.moegate_decode_stack.argtypes = [ctypes.POINTER(DecodeLayerParams), i64, p, i64, p, p, p, p, p, p, p, p,
                                             p, p, p, ctypes.c_double, p, ctypes.c_int, i64, i64]
    if hasattr(lib, "moegate_decode_step"):
        lib.moegate_decode_step.restype = ctypes.c_int
        lib.moegate_decode_step.argtypes = [ctypes.POINTER(DecodeStepArgs), i64, i64, ctypes.c_int, i64]
