"""Helpers the structured-decoding evals share: the evaluation data's place, percentiles, an even
sample of rows, and a compile bounded like the gateway's cache."""

from __future__ import annotations

import time
from pathlib import Path

from gateway.structured.base import ConstraintSpec
from gateway.structured.errors import ConstraintCompileTimeout
from gateway.structured.registry import get_backend
from gateway.structured.vocab import TokenizerInfo

DATA = Path("/work/shared/evaldata")


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def compile_timed(spec: ConstraintSpec, tok: TokenizerInfo, backend: str, timeout_s: float):
    """Compile with the same bound as the gateway's cache (thread + timeout)."""
    import concurrent.futures as cf

    impl = get_backend(spec.kind, backend)
    with cf.ThreadPoolExecutor(1) as pool:
        t0 = time.perf_counter()
        fut = pool.submit(impl.compile, spec, tok)
        try:
            compiled = fut.result(timeout=timeout_s)
        except cf.TimeoutError:
            raise ConstraintCompileTimeout(spec.kind, timeout_s) from None
        return compiled, time.perf_counter() - t0


def _sample(rows: list, n: int) -> list:
    """`n` rows evenly spread over `rows` (0: all of them)."""
    if not n or n >= len(rows):
        return rows
    return [rows[i * len(rows) // n] for i in range(n)]
