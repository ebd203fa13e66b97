"""`moegate eval`: the quality and performance report (evals/report.py)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="run the quality and performance suites and write a report (markdown + PNGs)")
    from evals.report import add_arguments

    add_arguments(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from evals.report import run

    return run(args)
