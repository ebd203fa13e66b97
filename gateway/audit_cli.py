"""`moegate audit verify FILE`: report the first tampered, reordered, removed or truncated audit record."""

from __future__ import annotations

import argparse
import sys

from gateway.audit import verify


def _verify(args: argparse.Namespace) -> int:
    status = 0
    for path in args.files:
        try:
            result = verify(path, args.head, use_head=not args.no_head)
        except OSError as exc:
            print(f"{path}: cannot read: {exc.strerror}", file=sys.stderr)
            status = 2
            continue
        if result.ok:
            print(f"{path}: ok: {result.records} records, head {result.head_hash}")
        else:
            print(f"{path}: record {result.first_bad_index} (line {result.first_bad_index + 1}): {result.reason}",
                  file=sys.stderr)
            status = max(status, 1)
    return status


def register(subparsers: argparse._SubParsersAction) -> None:
    audit = subparsers.add_parser("audit", help="audit log tools")
    sub = audit.add_subparsers(dest="audit_command", required=True)
    v = sub.add_parser("verify", help="check the hash chain; exit 1 naming the first bad record")
    v.add_argument("files", nargs="+", metavar="FILE")
    v.add_argument("--head", help="head checkpoint file (default: FILE.head when it exists)")
    v.add_argument("--no-head", action="store_true", help="ignore the head checkpoint")
    v.set_defaults(func=_verify)
