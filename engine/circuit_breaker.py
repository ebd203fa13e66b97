"""CircuitBreaker: stop calling a dependency that keeps failing or hanging, probe it again after a cool-down.

Used by every redis client (the gateway's limit store, the prefix cache's shared tier): socket timeouts
bound one call, the breaker bounds what a hung server costs overall. Closed: calls pass. After
`threshold` consecutive failures it opens and callers skip the call (their caller's fallback runs) for
`cooldown_s`; then one call probes (half-open) while the others keep skipping: its success closes the
breaker, its failure opens it for another cool-down.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class CircuitBreaker:
    def __init__(self, threshold: int = 3, cooldown_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if threshold < 1 or cooldown_s <= 0:
            raise ValueError(f"threshold must be >= 1 and cooldown_s > 0, got {threshold}, {cooldown_s}")
        self.threshold, self.cooldown_s, self._clock = threshold, cooldown_s, clock
        self._lock = threading.Lock()
        self._state = CLOSED
        self._failures = 0  # consecutive
        self._opened_at = 0.0
        self._probe_at: float | None = None  # when the half-open probe was let through
        self.opened = 0  # times the breaker opened
        self.skipped = 0  # calls not made because it was open

    @property
    def state(self) -> str:
        with self._lock:
            return self._state

    def retry_in(self) -> float:
        """Seconds until the next probe may run (0 when closed)."""
        with self._lock:
            if self._state == CLOSED:
                return 0.0
            return max(0.0, self._opened_at + self.cooldown_s - self._clock())

    def allow(self) -> bool:
        """True when the caller should make the call (and report it with `success` / `failure`)."""
        with self._lock:
            if self._state == CLOSED:
                return True
            now = self._clock()
            # a probe that never reported (its caller was cancelled) does not keep the breaker shut for good
            probe_free = self._probe_at is None or now - self._probe_at >= self.cooldown_s
            if now - self._opened_at >= self.cooldown_s and probe_free:
                self._state, self._probe_at = HALF_OPEN, now
                return True
            self.skipped += 1
            return False

    def success(self) -> bool:
        """Records a successful call; True when it closed an open breaker."""
        with self._lock:
            reopened = self._state != CLOSED
            self._state, self._failures, self._probe_at = CLOSED, 0, None
            return reopened

    def failure(self) -> bool:
        """Records a failed or timed-out call; True when it opened the breaker."""
        with self._lock:
            self._failures += 1
            if self._state == HALF_OPEN or (self._state == CLOSED and self._failures >= self.threshold):
                first = self._state == CLOSED
                self._state, self._opened_at, self._probe_at = OPEN, self._clock(), None
                self.opened += first
                return first
            return False
