"""`moegate eval`: the quality and performance report (evals/report.py)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="run the quality and performance suites and write a report (markdown + PNGs)")
    from evals.report import add_arguments

    add_arguments(p)
    p.set_defaults(func=_run)
    kernels = sub.choices.get("kernels")
    if kernels is not None:  # `moegate kernels bench`: the kernel benchmark of evals/perf
        bench = kernels.subcommands.add_parser("bench", help="run evals/perf/kernel_bench.py (pass its flags after --)")
        bench.add_argument("bench_args", nargs=argparse.REMAINDER)
        bench.set_defaults(func=_kernel_bench)


def _kernel_bench(args: argparse.Namespace) -> int:
    from evals.perf.kernel_bench import main

    rest = args.bench_args
    return main(rest[1:] if rest[:1] == ["--"] else rest)


def _run(args: argparse.Namespace) -> int:
    from evals.report import run

    return run(args)
