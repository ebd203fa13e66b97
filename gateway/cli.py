"""The `moegate` command: one subcommand per module that registers itself here."""

from __future__ import annotations

import argparse
import importlib
import sys

# Each module exposes `register(subparsers)` that adds its subcommand(s) and sets `func`.
_SUBCOMMAND_MODULES = [
    "engine.cli",
    "engine.model_cli",
    "engine.plan",
    "policies.cli",
    "gateway.audit_cli",
    "gateway.serve_cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moegate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in _SUBCOMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
