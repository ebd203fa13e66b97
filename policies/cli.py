"""`moegate policy check FILE | schema | hash-key`: validate policies, print the JSON Schema, hash API keys."""

from __future__ import annotations

import argparse
import json
import secrets
import sys

from policies.loader import PolicyError, load_policy
from policies.model import Policy, hash_api_key


def _check(args: argparse.Namespace) -> int:
    status = 0
    for path in args.files:
        try:
            policy = load_policy(path)
        except PolicyError as exc:
            for issue in exc.issues:
                print(issue.format(path), file=sys.stderr)
            status = 1
            continue
        print(f"{path}: ok: policy {policy.id!r} {policy.digest} ({len(policy.tenants)} tenants, "
              f"{len(policy.models)} models, {len(policy.routes)} routes)")
    return status


def _schema(args: argparse.Namespace) -> int:
    text = json.dumps(Policy.json_schema(), indent=2) + "\n"
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


def _hash_key(args: argparse.Namespace) -> int:
    if args.generate:
        key = "sk-" + secrets.token_urlsafe(32)
        print(f"key:  {key}\nhash: {hash_api_key(key)}")
        return 0
    key = args.key if args.key is not None else sys.stdin.readline().rstrip("\r\n")
    if not key:
        print("error: empty key (pass it as an argument, on stdin, or use --generate)", file=sys.stderr)
        return 2
    print(hash_api_key(key))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    policy = subparsers.add_parser("policy", help="validate policy files, print their JSON Schema")
    sub = policy.add_subparsers(dest="policy_command", required=True)
    check = sub.add_parser("check", help="validate policy YAML files; errors give file:line:col and field")
    check.add_argument("files", nargs="+", metavar="FILE")
    check.set_defaults(func=_check)
    schema = sub.add_parser("schema", help="print the policy JSON Schema (for editor validation)")
    schema.add_argument("--out", help="write to this file instead of stdout")
    schema.set_defaults(func=_schema)
    hk = sub.add_parser("hash-key", help="print the `sha256:<hex>` form of an API key for a policy file")
    hk.add_argument("key", nargs="?", help="the key (default: read one line from stdin, keeps it out of history)")
    hk.add_argument("--generate", action="store_true", help="generate a new random key and print key and hash")
    hk.set_defaults(func=_hash_key)
