"""Append-only, hash-chained audit log (one canonical JSON record per line) and its verifier."""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

FsyncPolicy = Literal["always", "interval", "never"]
GENESIS = "0" * 64
FORMAT_VERSION = 1
_FIELDS = {"v": int, "seq": int, "ts": str, "trace_id": (str, type(None)), "prev": str, "event": str,
           "data": dict, "hash": str}


class AuditLogError(Exception):
    """The audit log cannot be opened or appended to; the message says what to do."""


def canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def record_hash(record: Mapping[str, Any]) -> str:
    """sha256 over the canonical JSON of every field except `hash` itself."""
    return hashlib.sha256(canonical_json({k: v for k, v in record.items() if k != "hash"})).hexdigest()


def head_path_for(path: str | Path) -> Path:
    return Path(str(path) + ".head")


@dataclass(frozen=True)
class AuditRecord:
    seq: int
    hash: str
    prev: str
    trace_id: str | None
    line: bytes


class AuditLog:
    """One writer per file (an exclusive flock enforces it); thread-safe `append`, `aappend` for asyncio.

    fsync: `always` syncs every record before append returns; `interval` syncs at most every
    `fsync_interval_s` (a background thread syncs pending records); `never` leaves it to the OS.
    At every sync the head checkpoint `<path>.head` ({seq, hash} of the last synced record) is replaced,
    so `verify` also detects whole records cut from the end."""

    def __init__(self, path: str | Path, fsync: FsyncPolicy = "interval", fsync_interval_s: float = 1.0,
                 clock: Callable[[], datetime] = lambda: datetime.now(UTC)):
        if fsync not in ("always", "interval", "never"):
            raise ValueError(f"fsync must be always, interval or never, not {fsync!r}")
        self.path, self.fsync, self.fsync_interval_s, self._clock = Path(path), fsync, fsync_interval_s, clock
        self.head_path = head_path_for(self.path)
        self._lock = threading.Lock()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a+b")  # noqa: SIM115 (owned for the log's lifetime)
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise AuditLogError(f"{self.path} is open by another writer; give each process its own audit file"
                                ) from None
        self._seq, self._prev = self._recover_tail()
        self._synced_seq = self._seq - 1
        self._last_sync = time.monotonic()
        self._stop = threading.Event()
        self._syncer: threading.Thread | None = None
        if fsync == "interval":
            self._syncer = threading.Thread(target=self._sync_loop, name="audit-fsync", daemon=True)
            self._syncer.start()

    def _recover_tail(self) -> tuple[int, str]:
        """Next seq and prev hash from the last record; refuses to extend a damaged tail."""
        size = self._file.seek(0, os.SEEK_END)
        if size == 0:
            return 0, GENESIS
        back = min(size, 1 << 16)
        while True:
            self._file.seek(size - back)
            tail = self._file.read(back)
            if not tail.endswith(b"\n"):
                raise AuditLogError(f"{self.path}: the last record is incomplete (crash or truncation); "
                                    f"run `moegate audit verify {self.path}` and archive the file")
            start = tail.rfind(b"\n", 0, len(tail) - 1)
            if start >= 0 or back == size:
                break
            back = min(size, back * 4)
        try:
            last = json.loads(tail[start + 1:])
            ok = record_hash(last) == last["hash"]
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            raise AuditLogError(f"{self.path}: the last record does not verify; "
                                f"run `moegate audit verify {self.path}` and archive the file")
        return last["seq"] + 1, last["hash"]

    def append(self, event: str, data: Mapping[str, Any], trace_id: str | None = None) -> AuditRecord:
        with self._lock:
            if self._file.closed:
                raise AuditLogError(f"{self.path}: the audit log is closed")
            record = {"v": FORMAT_VERSION, "seq": self._seq, "ts": self._clock().isoformat(timespec="microseconds"),
                      "trace_id": trace_id, "prev": self._prev, "event": event, "data": dict(data)}
            try:
                record["hash"] = record_hash(record)
            except ValueError as exc:
                raise AuditLogError(f"audit data must be finite JSON: {exc}") from None
            line = canonical_json(record) + b"\n"
            self._file.write(line)
            self._file.flush()
            self._seq, self._prev = self._seq + 1, record["hash"]
            if self.fsync == "always" or (self.fsync == "interval"
                                          and time.monotonic() - self._last_sync >= self.fsync_interval_s):
                self._sync_locked()
            return AuditRecord(record["seq"], record["hash"], record["prev"], trace_id, line)

    async def aappend(self, event: str, data: Mapping[str, Any], trace_id: str | None = None) -> AuditRecord:
        """`append` off the event loop (fsync can take milliseconds)."""
        return await asyncio.to_thread(self.append, event, data, trace_id)

    def _sync_locked(self, durable: bool = True) -> None:
        if durable:
            os.fsync(self._file.fileno())
        self._last_sync = time.monotonic()
        if self._synced_seq == self._seq - 1:
            return
        self._synced_seq = self._seq - 1
        tmp = self.head_path.with_name(self.head_path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(canonical_json({"seq": self._synced_seq, "hash": self._prev}) + b"\n")
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, self.head_path)

    def sync(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._sync_locked()

    def _sync_loop(self) -> None:
        while not self._stop.wait(self.fsync_interval_s):
            with self._lock:
                if not self._file.closed and self._synced_seq != self._seq - 1:
                    self._sync_locked()

    def close(self) -> None:
        self._stop.set()
        if self._syncer is not None:
            self._syncer.join()
        with self._lock:
            if not self._file.closed:
                self._sync_locked(durable=self.fsync != "never")
                self._file.close()

    def __enter__(self) -> AuditLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def audit_data(level: str, metadata: Mapping[str, Any], content: Mapping[str, str],
               redact: Callable[[str], str] = lambda s: s) -> dict[str, Any] | None:
    """The `data` of one request's record at a policy audit level: `off` -> None (write nothing);
    `metadata` -> metadata plus sha256 of each content field; `full` -> metadata plus redacted content."""
    if level == "off":
        return None
    if level == "metadata":
        hashed = {f"{k}_sha256": hashlib.sha256(v.encode()).hexdigest() for k, v in content.items()}
        return {**metadata, **hashed}
    if level == "full":
        return {**metadata, **{k: redact(v) for k, v in content.items()}}
    raise ValueError(f"unknown audit level {level!r}")


@dataclass(frozen=True)
class VerifyResult:
    ok: bool
    records: int  # records read that verified before the first bad one (all of them when ok)
    first_bad_index: int | None  # 0-based record index (= line number - 1) of the first bad record
    reason: str
    head_hash: str | None = None  # hash of the last good record


def _check_record(raw: bytes, index: int, prev: str) -> str | None:
    if not raw.endswith(b"\n"):
        return "truncated: the record is incomplete (no line end)"
    try:
        rec = json.loads(raw)
    except ValueError:
        return "not valid JSON (tampered or truncated)"
    if not isinstance(rec, dict) or set(rec) != set(_FIELDS) or not all(
            isinstance(rec[k], t) and not isinstance(rec[k], bool) for k, t in _FIELDS.items()):
        return f"malformed: expected exactly the fields {sorted(_FIELDS)} with the right types"
    if record_hash(rec) != rec["hash"]:
        return "tampered: the record's content does not match its hash"
    if rec["seq"] < index:
        return f"out of sequence: expected seq {index}, found seq {rec['seq']} (records reordered or duplicated)"
    if rec["seq"] > index:
        return f"out of sequence: expected seq {index}, found seq {rec['seq']} (records removed or reordered)"
    if rec["prev"] != prev:
        return ("chain broken: prev does not match the previous record's hash "
                "(a record before it was rewritten, removed, inserted or moved)")
    return None


def verify(path: str | Path, head_path: str | Path | None = None, *, use_head: bool = True) -> VerifyResult:
    """Check every record's hash, sequence and link to its predecessor, then the head checkpoint
    (default `<path>.head` when present) so records cut from the end are reported too."""
    path = Path(path)
    head_path = head_path_for(path) if head_path is None else Path(head_path)
    prev, index = GENESIS, 0
    with open(path, "rb") as f:
        for raw in f:
            problem = _check_record(raw, index, prev)
            if problem is not None:
                return VerifyResult(False, index, index, problem, prev if index else None)
            prev = json.loads(raw)["hash"]
            index += 1
    head_hash = prev if index else None
    if use_head and head_path.exists():
        try:
            head = json.loads(head_path.read_bytes())
            head_seq, want = int(head["seq"]), str(head["hash"])
        except (ValueError, KeyError, TypeError):
            return VerifyResult(False, index, index, f"head checkpoint {head_path} is unreadable", head_hash)
        if head_seq >= index:
            return VerifyResult(False, index, index, f"truncated: the head checkpoint records seq {head_seq} "
                                                     f"but the log ends after {index} records", head_hash)
        with open(path, "rb") as f:
            for i, raw in enumerate(f):
                if i == head_seq:
                    if json.loads(raw)["hash"] != want:
                        return VerifyResult(False, index, head_seq, "tampered: the record does not match the "
                                                                    "head checkpoint (log rewritten)", head_hash)
                    break
    return VerifyResult(True, index, None, "ok", head_hash)
