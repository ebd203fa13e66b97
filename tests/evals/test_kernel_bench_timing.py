"""evals/perf/kernel_bench.py's alternating timer: rates from the calls a clock could time."""

import itertools

import pytest

from evals.perf.kernel_bench import interleaved


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
