"""The audit log's record format, shared by its writer (audit.py) and verifier (audit_verify.py): one canonical
JSON record per line, hash-chained.

A record's `v` names its chain: 1 = sha256 over the record (anyone who can write the file can rewrite the
chain), 2 = HMAC-SHA256 with the deployment's key (`MOEGATE_AUDIT_KEY`): rewriting it needs the key."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

GENESIS = "0" * 64
UNKEYED, KEYED = 1, 2  # the record's `v`: sha256 chain, HMAC-SHA256 chain
KEY_ENV = "MOEGATE_AUDIT_KEY"
QUARANTINE_EVENT = "audit.quarantine"  # the first record after a torn tail was moved aside
FIELDS = {"v": int, "seq": int, "ts": str, "trace_id": (str, type(None)), "prev": str, "event": str,
          "data": dict, "hash": str}


class AuditLogError(Exception):
    """The audit log cannot be opened or appended to; the message says what to do."""


_SURROGATE = re.compile("[\ud800-\udfff]")


def canonical_json(obj: Any) -> bytes:
    """Sorted, compact UTF-8 JSON; a lone UTF-16 surrogate (not encodable as UTF-8) is written as its JSON
    escape, so any text a client sends can be recorded and reads back the same."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text).encode()


def key_from_env(env: Mapping[str, str] = os.environ) -> bytes | None:
    """The chain key from `MOEGATE_AUDIT_KEY` (None when unset or empty)."""
    value = env.get(KEY_ENV, "")
    return value.encode() if value else None


def record_hash(record: Mapping[str, Any], key: bytes | None = None) -> str:
    """Over the canonical JSON of every field except `hash` itself: sha256 for `v` 1, HMAC-SHA256 with `key`
    for `v` 2."""
    return _body_hash(canonical_json({k: v for k, v in record.items() if k != "hash"}), record.get("v"), key)


def _body_hash(body: bytes, version: Any, key: bytes | None) -> str:
    if version == KEYED:
        if key is None:
            raise AuditLogError(f"the record is keyed (HMAC-SHA256); set {KEY_ENV} to its key")
        return hmac.new(key, body, hashlib.sha256).hexdigest()
    return hashlib.sha256(body).hexdigest()


def record_line(data: Mapping[str, Any], event: str, rest: dict[str, Any], key: bytes | None) -> tuple[str, bytes]:
    """(hash, canonical JSON line) of the record `{"data": data, "event": event, **rest}` plus its hash, the data
    serialised once for both: the keys sort as data, event, hash, then `rest`'s (prev, seq, trace_id, ts, v), so
    the line is the hashed body with `"hash":"..."` put in front of `rest`'s members."""
    tail = canonical_json(rest)  # {"prev":...,"v":...}
    body = canonical_json({"data": data, "event": event, **rest})
    head = body[:len(body) - len(tail) + 1]  # {"data":...,"event":...,
    digest = _body_hash(body, rest["v"], key)
    return digest, b"%s\"hash\":\"%s\",%s" % (head, digest.encode(), tail[1:])


def head_path_for(path: str | Path) -> Path:
    return Path(str(path) + ".head")
