"""The store interface: token-bucket rate limits, concurrency leases, windowed budgets, idempotency keys."""

from __future__ import annotations

import base64
import hashlib
import json
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal

OnUnavailable = Literal["fail_open", "fail_closed"]


class StoreUnavailable(Exception):
    """The backing store cannot be reached and the policy says fail_closed: answer 503, not 429."""


class IdempotencyKeyMismatch(Exception):
    """The Idempotency-Key was already used with a different request body: answer 422
    (IETF draft-ietf-httpapi-idempotency-key-header)."""


@dataclass(frozen=True)
class Decision:
    allowed: bool
    retry_after: float  # seconds until `cost` would be allowed; math.inf when cost > burst; 0 when allowed
    remaining: float  # tokens left in the bucket after this decision
    degraded: bool = False  # store unreachable and fail_open: allowed without checking


@dataclass(frozen=True)
class BudgetDecision:
    allowed: bool
    used: int  # consumed in the current window (including this amount when recorded)
    limit: int
    reset_after: float  # seconds until the window rolls over
    degraded: bool = False


@dataclass(frozen=True)
class StoredResponse:
    """What a repeated Idempotency-Key gets back: the first request's status, headers and body."""

    status: int
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()

    def to_json(self) -> str:
        return json.dumps({"status": self.status, "headers": [list(h) for h in self.headers],
                           "body": base64.b64encode(self.body).decode()})

    @classmethod
    def from_json(cls, text: str | bytes) -> StoredResponse:
        d = json.loads(text)
        return cls(d["status"], base64.b64decode(d["body"]), tuple((k, v) for k, v in d["headers"]))


class IdemState(StrEnum):
    NEW = "new"  # the caller owns the key: generate, then idempotency_complete (or _abandon on failure)
    COMPLETED = "completed"  # `response` holds the stored response: return it, do not generate
    IN_PROGRESS = "in_progress"  # another request still owns the key after waiting: answer 409


@dataclass(frozen=True)
class IdempotencyBegin:
    state: IdemState
    response: StoredResponse | None = None
    token: str | None = None  # owner token for complete/abandon when state is NEW
    degraded: bool = False  # store unreachable and fail_open: proceeding without idempotency


def request_fingerprint(method: str, path: str, body: Any) -> str:
    """sha256 over method, path and the canonical JSON of the body (dict key order does not matter)."""
    canonical = body if isinstance(body, bytes) else json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(method.upper().encode() + b" " + path.encode() + b"\n" + canonical).hexdigest()


class Lease:
    """A held concurrency slot. Release it (or use `async with`); it expires by itself after its TTL."""

    def __init__(self, release: Callable[[], Awaitable[None]] | None,
                 renew: Callable[[float], Awaitable[bool]] | None, degraded: bool = False):
        self._release, self._renew, self.degraded = release, renew, degraded
        self.released = False

    async def release(self) -> None:
        if not self.released:
            self.released = True
            if self._release is not None:
                await self._release()

    async def renew(self, ttl_s: float) -> bool:
        """Extend the lease; False when it had already expired (the slot may have been taken)."""
        return True if self._renew is None else await self._renew(ttl_s)

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.release()


class Store(ABC):
    """One small async interface; keys are opaque strings the caller namespaces (e.g. `tenant:key`)."""

    @abstractmethod
    async def rate_limit(self, key: str, rate: float, burst: float, cost: float = 1.0) -> Decision:
        """Token bucket refilled at `rate` tokens/s up to `burst`; take `cost` tokens if available."""

    @abstractmethod
    async def acquire_concurrency(self, key: str, limit: int, ttl_s: float = 300.0) -> Lease | None:
        """A lease if fewer than `limit` are held for `key`, else None."""

    @abstractmethod
    async def budget_consume(self, key: str, amount: int, limit: int, window_s: int,
                             *, force: bool = False) -> BudgetDecision:
        """Add `amount` to the fixed window's counter unless that would exceed `limit`.
        `force` records it regardless (actual usage known after the fact); `allowed` then says used <= limit."""

    @abstractmethod
    async def _idem_try(self, key: str, fingerprint: str, lock_ttl_s: float) -> IdempotencyBegin:
        """One atomic attempt: claim the key, or report it completed / in progress."""

    @abstractmethod
    async def _idem_wait(self, key: str, timeout_s: float) -> None:
        """Sleep until the key may have changed, at most `timeout_s`."""

    @abstractmethod
    async def idempotency_complete(self, key: str, token: str | None, response: StoredResponse,
                                   ttl_s: float = 86400.0) -> bool:
        """Store the response for later repeats; False when `token` no longer owns the key."""

    @abstractmethod
    async def idempotency_abandon(self, key: str, token: str | None) -> None:
        """Release an owned key without a response (generation failed), so a retry can run."""

    async def idempotency_begin(self, key: str, fingerprint: str, *, wait_s: float = 0.0,
                                lock_ttl_s: float = 300.0) -> IdempotencyBegin:
        """Claim `key` for this request. A completed key returns its stored response; an in-flight duplicate
        waits up to `wait_s` for the first request to finish (or abandon, in which case this one takes over).
        Raises IdempotencyKeyMismatch when the key was used with another fingerprint."""
        deadline = time.monotonic() + wait_s
        while True:
            result = await self._idem_try(key, fingerprint, lock_ttl_s)
            remaining = deadline - time.monotonic()
            if result.state is not IdemState.IN_PROGRESS or remaining <= 0:
                return result
            await self._idem_wait(key, remaining)

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        return None

