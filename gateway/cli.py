"""The `moegate` command: one subcommand per module that registers itself here."""

from __future__ import annotations

import argparse
import importlib
import sys

# Each module exposes `register(subparsers)` that adds its subcommand(s) and sets `func`.
_SUBCOMMAND_MODULES = [
    "engine.cli",
    "modeltools.model_cli",
    "modeltools.plan",
    "kernels.cli",
    "policies.cli",
    "gateway.audit_cli",
    "gateway.serve_cli",
    "evals.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moegate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in _SUBCOMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from engine.errors import EngineError

    try:
        return int(args.func(args) or 0)
    except EngineError as exc:  # a problem the user can fix: say it in one line, no traceback
        parser.exit(2, f"moegate {args.command}: error: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
