"""`moegate audit verify FILE`: report the first tampered, reordered, removed or truncated audit record,
whether the chain is keyed, and the torn tails that were quarantined."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gateway.audit_record import KEY_ENV, key_from_env
from gateway.audit_verify import verify


def _key(args: argparse.Namespace) -> bytes | None:
    if args.key_file:
        return Path(args.key_file).read_bytes().rstrip(b"\r\n") or None
    return key_from_env()


def _verify(args: argparse.Namespace) -> int:
    status = 0
    try:
        key = _key(args)
    except OSError as exc:
        print(f"{args.key_file}: cannot read the key: {exc.strerror}", file=sys.stderr)
        return 2
    for path in args.files:
        try:
            result = verify(path, args.head, use_head=not args.no_head, key=key)
        except OSError as exc:
            print(f"{path}: cannot read: {exc.strerror}", file=sys.stderr)
            status = 2
            continue
        if result.ok:
            print(f"{path}: ok: {result.records} records, {result.chain}, head {result.head_hash}")
        else:
            print(f"{path}: record {result.first_bad_index} (line {result.first_bad_index + 1}): {result.reason}",
                  file=sys.stderr)
            status = max(status, 1)
        for q in result.quarantined:
            state = "kept" if q["kept"] else "MISSING or altered"
            print(f"{path}: record {q['index']}: a torn tail of {q['bytes']} bytes was quarantined in "
                  f"{q['file']} ({state})")
    return status


def register(subparsers: argparse._SubParsersAction) -> None:
    audit = subparsers.add_parser("audit", help="audit log tools")
    sub = audit.add_subparsers(dest="audit_command", required=True)
    v = sub.add_parser("verify", help="check the hash chain; exit 1 naming the first bad record",
                       description=f"Keyed chains (HMAC-SHA256) are checked with the key from --key-file, "
                                   f"else ${KEY_ENV}.")
    v.add_argument("files", nargs="+", metavar="FILE")
    v.add_argument("--head", help="head checkpoint file (default: FILE.head when it exists)")
    v.add_argument("--no-head", action="store_true", help="ignore the head checkpoint")
    v.add_argument("--key-file", help=f"file holding the chain key (default: ${KEY_ENV})")
    v.set_defaults(func=_verify)
