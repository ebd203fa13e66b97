"""PolicyHolder: the current policy, reloaded on SIGHUP or file change; a bad file never replaces a good one."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from policies.loader import PolicyError, PolicyIssue, parse_policy
from policies.model import Policy

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReloadResult:
    changed: bool  # a new policy is now current
    error: PolicyError | None  # the file was invalid; the previous policy stays current


class PolicyHolder:
    """Holds the last good policy from `path`. The first load must succeed (raises PolicyError)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._listeners: list[Callable[[Policy], None]] = []
        self._stat: tuple[int, int, int] | None = None
        self._content_hash = ""
        self.last_error: PolicyError | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._checks: list[Callable[[Policy, Policy], list[PolicyIssue]]] = []
        self._policy, self._content_hash = self._read()

    @property
    def current(self) -> Policy:
        return self._policy

    def on_change(self, callback: Callable[[Policy], None]) -> None:
        """Call `callback(new_policy)` after each successful reload that changed the policy."""
        self._listeners.append(callback)

    def add_check(self, check: Callable[[Policy, Policy], list[PolicyIssue]]) -> None:
        """Before a reload replaces the policy, `check(new, current)` lists why the running process cannot
        take it (e.g. it drops the served model); any issue rejects the reload and the current policy stays."""
        self._checks.append(check)

    def _file_stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _read(self) -> tuple[Policy, str]:
        self._stat = self._file_stat()
        try:
            raw = self.path.read_bytes()
        except OSError as exc:
            raise PolicyError(str(self.path), [PolicyIssue("", f"cannot read file: {exc.strerror}", None, None)]) from None
        digest = hashlib.sha256(raw).hexdigest()
        policy = parse_policy(raw.decode("utf-8", errors="replace"), str(self.path))
        return policy, digest

    def reload(self) -> ReloadResult:
        """Re-read the file now. Invalid: keep the current policy, log and return the error."""
        with self._lock:
            previous = self._content_hash
            try:
                policy, digest = self._read()
                if digest == previous:
                    self.last_error = None
                    return ReloadResult(changed=False, error=None)
                issues = [issue for check in self._checks for issue in check(policy, self._policy)]
                if issues:
                    raise PolicyError(str(self.path), issues)
            except PolicyError as exc:
                self.last_error = exc
                log.error("policy reload rejected, keeping %s (%s): %s", self._policy.id,
                          self._policy.digest, exc)
                return ReloadResult(changed=False, error=exc)
            self.last_error = None
            self._policy, self._content_hash = policy, digest
            log.info("policy reloaded: %s %s", policy.id, policy.digest)
        for callback in self._listeners:
            callback(policy)
        return ReloadResult(changed=True, error=None)

    def poll(self) -> ReloadResult | None:
        """Reload if the file's mtime, size or inode changed since the last read; None when unchanged."""
        if self._file_stat() == self._stat:
            return None
        return self.reload()

    def install_sighup(self, loop=None) -> None:
        """Reload on SIGHUP: through `loop.add_signal_handler` when given an asyncio loop, else signal.signal
        (main thread only)."""
        if loop is not None:
            loop.add_signal_handler(signal.SIGHUP, self.reload)
        else:
            signal.signal(signal.SIGHUP, lambda signum, frame: self.reload())

    async def watch_async(self, interval_s: float = 2.0) -> None:
        """Poll from an asyncio task (listeners then run on the event loop): create_task(holder.watch_async())."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - a failing check or listener must not stop the watching
                log.exception("policy reload of %s failed", self.path)

    def start_watching(self, interval_s: float = 2.0) -> None:
        """Poll the file every `interval_s` seconds on a daemon thread until stop()."""
        if self._thread is not None:
            return
        self._stop.clear()

        def loop() -> None:
            while not self._stop.wait(interval_s):
                try:
                    self.poll()
                except Exception:  # noqa: BLE001 - a failing check or listener must not stop the watching
                    log.exception("policy reload of %s failed", self.path)

        self._thread = threading.Thread(target=loop, name="policy-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
