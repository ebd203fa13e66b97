"""`verify`: an audit log checked record by record (hash or HMAC, sequence, link to its predecessor), then
against its head checkpoint; the quarantined torn tails it names."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from gateway.audit_record import (
    FIELDS,
    GENESIS,
    KEY_ENV,
    KEYED,
    QUARANTINE_EVENT,
    UNKEYED,
    head_path_for,
    record_hash,
)


@dataclass(frozen=True)
class VerifyResult:
    ok: bool
    records: int  # records read that verified before the first bad one (all of them when ok)
    first_bad_index: int | None  # 0-based record index (= line number - 1) of the first bad record
    reason: str
    head_hash: str | None = None  # hash of the last good record
    keyed_records: int = 0  # records whose HMAC was checked with the key
    quarantined: tuple[dict, ...] = ()  # `audit.quarantine` records: {index, file, bytes, sha256, kept}

    @property
    def chain(self) -> str:
        if self.keyed_records == 0:
            return "unkeyed (sha256)"
        if self.keyed_records == self.records:
            return "keyed (HMAC-SHA256)"
        return f"{self.records - self.keyed_records} unkeyed records, then keyed (HMAC-SHA256)"


def _check_record(raw: bytes, index: int, prev: str, key: bytes | None, after_keyed: bool) -> str | None:
    if not raw.endswith(b"\n"):
        return "truncated: the record is incomplete (no line end)"
    try:
        rec = json.loads(raw)
    except ValueError:
        return "not valid JSON (tampered or truncated)"
    if not isinstance(rec, dict) or set(rec) != set(FIELDS) or not all(
            isinstance(rec[k], t) and not isinstance(rec[k], bool) for k, t in FIELDS.items()):
        return f"malformed: expected exactly the fields {sorted(FIELDS)} with the right types"
    if rec["v"] not in (UNKEYED, KEYED):
        return f"malformed: unknown record version {rec['v']}"
    if rec["v"] == KEYED and key is None:
        return f"keyed: the record carries an HMAC-SHA256; give its key ({KEY_ENV} or --key-file) to verify it"
    if rec["v"] == UNKEYED and after_keyed:
        return "downgraded: an unkeyed record after keyed ones (the chain was rewritten without the key)"
    if record_hash(rec, key) != rec["hash"]:
        if rec["v"] == KEYED:
            return "tampered or another key: the record's HMAC does not match"
        return "tampered: the record's content does not match its hash"
    if rec["seq"] < index:
        return f"out of sequence: expected seq {index}, found seq {rec['seq']} (records reordered or duplicated)"
    if rec["seq"] > index:
        return f"out of sequence: expected seq {index}, found seq {rec['seq']} (records removed or reordered)"
    if rec["prev"] != prev:
        return ("chain broken: prev does not match the previous record's hash "
                "(a record before it was rewritten, removed, inserted or moved)")
    return None


def _quarantine_entry(path: Path, index: int, data: dict) -> dict:
    aside = path.with_name(str(data.get("file", "")))
    kept = aside.is_file() and hashlib.sha256(aside.read_bytes()).hexdigest() == data.get("sha256")
    return {"index": index, "file": str(aside), "bytes": data.get("bytes"), "sha256": data.get("sha256"),
            "kept": kept}


def verify(path: str | Path, head_path: str | Path | None = None, *, use_head: bool = True,
           key: bytes | None = None) -> VerifyResult:
    """Check every record's hash (HMAC with `key` for keyed records), sequence and link to its predecessor,
    then the head checkpoint (default `<path>.head` when present) so records cut from the end are reported
    too. With a key, a log that has no keyed record, or an unkeyed record after a keyed one, fails."""
    path = Path(path)
    head_path = head_path_for(path) if head_path is None else Path(head_path)
    prev, index, keyed = GENESIS, 0, 0
    quarantined: list[dict] = []
    with open(path, "rb") as f:
        for raw in f:
            problem = _check_record(raw, index, prev, key, keyed > 0)
            if problem is not None:
                return VerifyResult(False, index, index, problem, prev if index else None, keyed, tuple(quarantined))
            rec = json.loads(raw)
            keyed += rec["v"] == KEYED
            if rec["event"] == QUARANTINE_EVENT:
                quarantined.append(_quarantine_entry(path, index, rec["data"]))
            prev = rec["hash"]
            index += 1
    head_hash = prev if index else None

    def failed(at: int, reason: str) -> VerifyResult:
        return VerifyResult(False, index, at, reason, head_hash, keyed, tuple(quarantined))

    if key is not None and index and not keyed:
        return failed(0, "not keyed: a key was given but no record carries an HMAC (written without the key, "
                         "or rewritten without it)")
    if use_head and head_path.exists():
        try:
            head = json.loads(head_path.read_bytes())
            head_seq, want = int(head["seq"]), str(head["hash"])
        except (ValueError, KeyError, TypeError):
            return failed(index, f"head checkpoint {head_path} is unreadable")
        if head_seq >= index:
            return failed(index, f"truncated: the head checkpoint records seq {head_seq} "
                                 f"but the log ends after {index} records")
        with open(path, "rb") as f:
            for i, raw in enumerate(f):
                if i == head_seq:
                    if json.loads(raw)["hash"] != want:
                        return failed(head_seq, "tampered: the record does not match the head checkpoint "
                                                "(log rewritten)")
                    break
    return VerifyResult(True, index, None, "ok", head_hash, keyed, tuple(quarantined))
