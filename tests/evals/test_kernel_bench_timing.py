"""evals/perf/kernel_bench.py's alternating timer: rates from the calls a clock could time."""

import itertools

import pytest

from evals.perf.kernel_baselines import path_contenders
from evals.perf.kernel_bench import interleaved
from kernels import build
from kernels.fused_moe import kernel_library


def _clock(readings):
    it = iter(readings)
    return lambda: next(it)


def test_zero_time_calls_are_counted_not_divided():
    # one contender, 1 round, 3 calls (the floor): start/end readings per call; the middle call reads 0 s
    ticks = itertools.chain([0.0, 0.001, 0.001, 0.001, 0.001, 0.003], itertools.repeat(1.0))
    out = interleaved({"k": lambda i: None}, lambda i: 1_000_000, 0.0, 1, _clock(ticks))["k"]
    assert out["calls"] == 3 and out["zero_time_calls"] == 1
    assert out["gbps_best"] == pytest.approx(1.0) and out["gbps_median"] == pytest.approx(1.0)


def test_a_clock_that_never_moves_is_a_clear_error():
    with pytest.raises(ValueError, match="--clock wall"):
        interleaved({"k": lambda i: None}, lambda i: 1, 0.0, 1, lambda: 5.0)


def test_path_limit_contenders_run_under_their_limit_and_restore_it():
    """--path-limit amx,zmm: one contender per limit, each call under its limit, the kernel's limit restored after."""
    lib = kernel_library()
    if lib is None or not hasattr(lib, "moegate_path_limit"):
        pytest.skip("no compiled kernel here")
    seen = []
    contenders = path_contenders(lib, lambda i: seen.append(lib.moegate_path_limit(-1)), "int8_a8", ["amx", "zmm"])
    assert list(contenders) == ["moegate[amx] int8_a8", "moegate[zmm] int8_a8"]
    before = lib.moegate_path_limit(-1)
    for fn in contenders.values():
        fn(0)
    assert seen == [build.PATH_LEVELS["amx"], build.PATH_LEVELS["zmm"]]
    assert lib.moegate_path_limit(-1) == before
    assert list(path_contenders(lib, lambda i: None, "int4", [])) == ["moegate int4"]
