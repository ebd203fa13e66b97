"""Append-only, hash-chained audit log: its writer (`AuditLog`: one canonical JSON record per line, the head
checkpoint, torn tails quarantined) and the `data` of a request's record by audit level. The record format is
audit_record.py's; `verify` (audit_verify.py) checks a log."""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from gateway.audit_record import (
    GENESIS,
    KEY_ENV,
    KEYED,
    QUARANTINE_EVENT,
    UNKEYED,
    AuditLogError,
    canonical_json,
    head_path_for,
    record_hash,
    record_line,
)

log = logging.getLogger(__name__)
FsyncPolicy = Literal["always", "interval", "never"]
_HEAD_WIDTH = 120  # {"hash": 64 hex, "seq": up to 20 digits} padded, so in-place rewrites cover the last


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
            digest, line = record_line(json.loads(canonical_json(dict(data))), event, rest, self.key)
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

