"""Append-only, hash-chained audit log (one canonical JSON record per line) and its verifier.

A record's `v` names its chain: 1 = sha256 over the record (anyone who can write the file can rewrite the
chain), 2 = HMAC-SHA256 with the deployment's key (`MOEGATE_AUDIT_KEY`): rewriting it needs the key."""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import hmac
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger(__name__)
FsyncPolicy = Literal["always", "interval", "never"]
GENESIS = "0" * 64
UNKEYED, KEYED = 1, 2  # the record's `v`: sha256 chain, HMAC-SHA256 chain
KEY_ENV = "MOEGATE_AUDIT_KEY"
QUARANTINE_EVENT = "audit.quarantine"
_HEAD_WIDTH = 120  # {"hash": 64 hex, "seq": up to 20 digits} padded, so in-place rewrites cover the last  # the first record after a torn tail was moved aside
_FIELDS = {"v": int, "seq": int, "ts": str, "trace_id": (str, type(None)), "prev": str, "event": str,
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


def _record_line(data: Mapping[str, Any], event: str, rest: dict[str, Any], key: bytes | None) -> tuple[str, bytes]:
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
    The head checkpoint `<path>.head` ({seq, hash} of the last synced record; with `never`, of the last
    record) is replaced at every sync, so `verify` also detects whole records cut from the end.
    `key` makes the chain HMAC-SHA256 (records `v` 2). A torn last line (a crash during a write) is moved to
    `<path>.torn-<time>` and the chain goes on with an `audit.quarantine` record that names it."""

    def __init__(self, path: str | Path, fsync: FsyncPolicy = "interval", fsync_interval_s: float = 1.0,
                 clock: Callable[[], datetime] = lambda: datetime.now(UTC), key: bytes | None = None):
        if fsync not in ("always", "interval", "never"):
            raise ValueError(f"fsync must be always, interval or never, not {fsync!r}")
        self.path, self.fsync, self.fsync_interval_s, self._clock = Path(path), fsync, fsync_interval_s, clock
        self.key, self._v = key, KEYED if key else UNKEYED
        self._head_fd: int | None = None  # `never`: the head rewritten in place after every append
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
        try:
            torn = self._quarantine_torn_tail()
            self._seq, self._prev = self._recover_tail()
        except BaseException:
            self._file.close()
            raise
        self._synced_seq = self._seq - 1
        self._last_sync = time.monotonic()
        self._stop = threading.Event()
        self._syncer: threading.Thread | None = None
        if fsync == "interval":
            self._syncer = threading.Thread(target=self._sync_loop, name="audit-fsync", daemon=True)
            self._syncer.start()
        if torn is not None:
            self.append(QUARANTINE_EVENT, torn)
            self.sync()

    def _line_start(self, end: int) -> int:
        """Offset just after the last b"\\n" before `end` (0 when there is none)."""
        back = min(end, 1 << 16)
        while True:
            self._file.seek(end - back)
            found = self._file.read(back).rfind(b"\n")
            if found >= 0:
                return end - back + found + 1
            if back == end:
                return 0
            back = min(end, back * 4)

    def _quarantine_torn_tail(self) -> dict | None:
        """Move bytes after the last line end (a record torn by a crash) to `<path>.torn-<time>`, durably,
        and cut them from the log; what was moved, for the quarantine record."""
        size = self._file.seek(0, os.SEEK_END)
        if size == 0:
            return None
        self._file.seek(size - 1)
        if self._file.read(1) == b"\n":
            return None
        keep = self._line_start(size)
        self._file.seek(keep)
        torn = self._file.read()
        aside = self.path.with_name(f"{self.path.name}.torn-{self._clock().strftime('%Y%m%dT%H%M%S.%fZ')}")
        with open(aside, "xb") as f:
            f.write(torn)
            f.flush()
            os.fsync(f.fileno())
        self._file.truncate(keep)
        os.fsync(self._file.fileno())
        log.warning("%s: the last record was incomplete (%d bytes, a crash during a write); moved to %s",
                    self.path, len(torn), aside)
        return {"file": aside.name, "bytes": len(torn), "sha256": hashlib.sha256(torn).hexdigest(),
                "offset": keep, "reason": "the last line was incomplete (a crash or a cut during a write)"}

    def _recover_tail(self) -> tuple[int, str]:
        """Next seq and prev hash from the last record; refuses to extend a record that does not verify
        (altered, or keyed with another key)."""
        size = self._file.seek(0, os.SEEK_END)
        if size == 0:
            return 0, GENESIS
        start = self._line_start(size - 1)
        self._file.seek(start)
        raw = self._file.read(size - start)
        try:
            last = json.loads(raw)
            keyed = last.get("v") == KEYED
        except (ValueError, AttributeError):
            last, keyed = None, False
        if keyed and self.key is None:
            raise AuditLogError(f"{self.path} is keyed (HMAC-SHA256): set {KEY_ENV} to the key it was written with")
        try:
            ok = last is not None and record_hash(last, self.key) == last["hash"]
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            why = "does not verify with this key (another key, or altered)" if keyed else "does not verify"
            raise AuditLogError(f"{self.path}: the last record {why}; "
                                f"run `moegate audit verify {self.path}` and archive the file")
        return last["seq"] + 1, last["hash"]

    def append(self, event: str, data: Mapping[str, Any], trace_id: str | None = None) -> AuditRecord:
        with self._lock:
            return self._append_locked(event, data, trace_id)

    def _append_locked(self, event: str, data: Mapping[str, Any], trace_id: str | None,
                       sync_due: bool = True) -> AuditRecord:
        """`sync_due` False: an `interval` record is left to the background syncer (within the interval)."""
        if self._file.closed:
            raise AuditLogError(f"{self.path}: the audit log is closed")
        rest = {"prev": self._prev, "seq": self._seq, "trace_id": trace_id,
                "ts": self._clock().isoformat(timespec="microseconds"), "v": self._v}
        try:  # hashed as it will read back (JSON types; escaped surrogates re-pair as json.loads does)
            digest, line = _record_line(json.loads(canonical_json(dict(data))), event, rest, self.key)
        except (ValueError, TypeError) as exc:
            raise AuditLogError(f"audit data must be finite JSON: {exc}") from None
        line += b"\n"
        self._file.write(line)
        self._file.flush()
        seq, prev = self._seq, self._prev
        self._seq, self._prev = self._seq + 1, digest
        if self.fsync == "always" or (self.fsync == "interval" and sync_due
                                      and time.monotonic() - self._last_sync >= self.fsync_interval_s):
            self._sync_locked()
        elif self.fsync == "never":
            self._overwrite_head()  # no durability promised, but a cut tail stays detectable
        return AuditRecord(seq, digest, prev, trace_id, line)

    async def aappend(self, event: str, data: Mapping[str, Any], trace_id: str | None = None) -> AuditRecord:
        """`append` for asyncio: on the event loop where nothing can wait on the disk (not `always`, the lock free:
        the record goes to the page cache, an `interval` sync is left to the syncer thread), else in a thread
        (fsync can take milliseconds). A thread hop costs the loop GIL hand-offs with the engine thread."""
        if self.fsync != "always" and self._lock.acquire(blocking=False):
            try:
                return self._append_locked(event, data, trace_id, sync_due=False)
            finally:
                self._lock.release()
        return await asyncio.to_thread(self.append, event, data, trace_id)

    def _sync_locked(self, durable: bool = True) -> None:
        if durable:
            os.fsync(self._file.fileno())
        self._last_sync = time.monotonic()
        self._write_head(durable)

    def _write_head(self, durable: bool) -> None:
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

    def _overwrite_head(self) -> None:
        """The head rewritten in place (a few microseconds, where a rename costs hundreds): fixed width,
        padded with spaces, so every write covers the previous one."""
        if self._head_fd is None:
            self._head_fd = os.open(self.head_path, os.O_WRONLY | os.O_CREAT, 0o644)
        self._synced_seq = self._seq - 1
        os.pwrite(self._head_fd, canonical_json({"seq": self._synced_seq, "hash": self._prev}).ljust(_HEAD_WIDTH)
                  + b"\n", 0)

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
            if self._head_fd is not None:
                os.close(self._head_fd)
                self._head_fd = None

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
        hashed = {f"{k}_sha256": hashlib.sha256(v.encode("utf-8", "surrogatepass")).hexdigest()
                  for k, v in content.items()}
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
    if not isinstance(rec, dict) or set(rec) != set(_FIELDS) or not all(
            isinstance(rec[k], t) and not isinstance(rec[k], bool) for k, t in _FIELDS.items()):
        return f"malformed: expected exactly the fields {sorted(_FIELDS)} with the right types"
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
