"""Redis store: every read-modify-write is one Lua script (atomic across replicas, server clock);
an unreachable or hung redis fails open or closed per policy within a bounded time (socket timeouts on
every call, then a circuit breaker skips redis until a probe succeeds), and the client reconnects when
redis returns."""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ConstantBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from engine.circuit_breaker import CircuitBreaker
from gateway.stores.base import (
    BudgetDecision,
    Decision,
    IdempotencyBegin,
    IdempotencyKeyMismatch,
    IdemState,
    Lease,
    OnUnavailable,
    Store,
    StoredResponse,
    StoreUnavailable,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
_UNAVAILABLE = (RedisConnectionError, RedisTimeoutError, OSError, asyncio.TimeoutError)

_NOW = "local t = redis.call('TIME') local now = tonumber(t[1]) + tonumber(t[2]) / 1000000 "

# KEYS[1] bucket hash; ARGV rate, burst, cost -> {allowed, retry_after ("-1" = never), remaining}
_RATE_LIMIT = _NOW + """
local rate, burst, cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local s = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens, ts = tonumber(s[1]), tonumber(s[2])
if tokens == nil then tokens, ts = burst, now end
tokens = math.min(burst, tokens + math.max(0, now - ts) * rate)
local allowed, retry = 0, 0
if tokens >= cost then tokens = tokens - cost allowed = 1
elseif cost > burst then retry = -1
else retry = (cost - tokens) / rate end
redis.call('HSET', KEYS[1], 'tokens', tokens, 'ts', now)
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 1000)
return {allowed, tostring(retry), tostring(tokens)}
"""

# KEYS[1] zset of lease tokens scored by expiry (ms); ARGV limit, ttl_ms, token -> 1 acquired / 0 full
_ACQUIRE = _NOW + """
local now_ms = math.floor(now * 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], now_ms + tonumber(ARGV[2]), ARGV[3])
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
redis.call('PEXPIREAT', KEYS[1], math.floor(tonumber(last[2])) + 1000)
return 1
"""

# KEYS[1] zset; ARGV ttl_ms, token -> 1 renewed / 0 expired
_RENEW = _NOW + """
local now_ms = math.floor(now * 1000)
local score = redis.call('ZSCORE', KEYS[1], ARGV[2])
if not score or tonumber(score) <= now_ms then redis.call('ZREM', KEYS[1], ARGV[2]) return 0 end
redis.call('ZADD', KEYS[1], now_ms + tonumber(ARGV[1]), ARGV[2])
local last = redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
redis.call('PEXPIREAT', KEYS[1], math.floor(tonumber(last[2])) + 1000)
return 1
"""

# KEYS[1] budget hash {w, used}; ARGV amount, limit, window_s, force -> {allowed, used, reset_after}
_BUDGET = _NOW + """
local amount, limit, window = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local w = math.floor(now / window)
local s = redis.call('HMGET', KEYS[1], 'w', 'used')
local used = 0
if tonumber(s[1]) == w then used = tonumber(s[2]) end
local reset = tostring((w + 1) * window - now)
if used + amount > limit and ARGV[4] ~= '1' then return {0, used, reset} end
used = used + amount
redis.call('HSET', KEYS[1], 'w', w, 'used', used)
redis.call('EXPIRE', KEYS[1], window + 60)
if used <= limit then return {1, used, reset} end
return {0, used, reset}
"""

# KEYS[1] idempotency hash; ARGV fingerprint, token, lock_ttl_ms -> {state[, response]}
_IDEM_BEGIN = """
local h = redis.call('HMGET', KEYS[1], 'fp', 'state', 'resp')
if not h[1] then
  redis.call('HSET', KEYS[1], 'fp', ARGV[1], 'state', 'pending', 'token', ARGV[2])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {'new'}
end
if h[1] ~= ARGV[1] then return {'mismatch'} end
if h[2] == 'done' then return {'completed', h[3]} end
return {'in_progress'}
"""

# KEYS[1]; ARGV token, response, ttl_ms -> 1 stored / 0 not the owner any more
_IDEM_COMPLETE = """
local h = redis.call('HMGET', KEYS[1], 'token', 'state')
if h[1] ~= ARGV[1] or h[2] ~= 'pending' then return 0 end
redis.call('HSET', KEYS[1], 'state', 'done', 'resp', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""

# KEYS[1]; ARGV token -> 1 released / 0 not the owner
_IDEM_ABANDON = """
local h = redis.call('HMGET', KEYS[1], 'token', 'state')
if h[1] ~= ARGV[1] or h[2] ~= 'pending' then return 0 end
redis.call('DEL', KEYS[1])
return 1
"""


CONNECT_TIMEOUT_FLOOR_S = 2.0


class RedisStore(Store):
    def __init__(self, url: str, on_unavailable: OnUnavailable = "fail_closed", *, prefix: str = "moegate:",
                 timeout_s: float = 0.5, poll_s: float = 0.02, max_connections: int = 64,
                 pool_wait_s: float = 5.0, breaker: CircuitBreaker | None = None):
        if on_unavailable not in ("fail_open", "fail_closed"):
            raise ValueError(f"on_unavailable must be fail_open or fail_closed, not {on_unavailable!r}")
        self.url, self.on_unavailable, self.prefix, self.poll_s = url, on_unavailable, prefix, poll_s
        self.breaker = breaker or CircuitBreaker()
        # one quick retry on a broken connection only: after a redis restart the pooled connection is dead
        # and the retry reconnects; a timeout is not retried (a hung server would just cost it twice).
        # A bounded pool that queues callers: an unbounded one opens a socket per concurrent request and
        # redis-py then fails bursts with MaxConnectionsError, which would read as "redis unavailable"
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=pool_wait_s,
            # a connection is opened once per pooled socket: its timeout tolerates an event loop busy for a
            # moment (a burst of coroutines), while every call keeps the policy's timeout
            socket_timeout=timeout_s, socket_connect_timeout=max(timeout_s, CONNECT_TIMEOUT_FLOOR_S),
            retry=Retry(ConstantBackoff(0.01), 1, supported_errors=(RedisConnectionError,)),
        )
        self._pool = pool
        self._redis = aioredis.Redis(connection_pool=pool)
        r = self._redis
        self._rate = r.register_script(_RATE_LIMIT)
        self._acquire = r.register_script(_ACQUIRE)
        self._renew = r.register_script(_RENEW)
        self._budget = r.register_script(_BUDGET)
        self._begin = r.register_script(_IDEM_BEGIN)
        self._complete = r.register_script(_IDEM_COMPLETE)
        self._abandon = r.register_script(_IDEM_ABANDON)
        self.available = True

    async def _guard(self, op: Callable[[], Awaitable[T]], fallback: Callable[[], T], what: str) -> T:
        if not self.breaker.allow():
            return self._unavailable(fallback, what, f"circuit open after {self.breaker.threshold} consecutive "
                                                     f"failures, next probe in {self.breaker.retry_in():.1f} s")
        try:
            result = await op()
        except _UNAVAILABLE as exc:
            if self.available:
                log.warning("redis %s unreachable (%s: %s); %s", self.url, type(exc).__name__, exc,
                            self.on_unavailable)
            self.available = False
            if self.breaker.failure():
                log.warning("redis %s: circuit open after %d consecutive failures; %s without calling it for "
                            "%.1f s, then one probe", self.url, self.breaker.threshold, self.on_unavailable,
                            self.breaker.cooldown_s)
            return self._unavailable(fallback, what, f"{type(exc).__name__}: {exc}", exc)
        self.breaker.success()
        if not self.available:
            log.warning("redis %s reachable again", self.url)
            self.available = True
        return result

    def _unavailable(self, fallback: Callable[[], T], what: str, why: str, cause: BaseException | None = None) -> T:
        if self.on_unavailable == "fail_open":
            return fallback()
        raise StoreUnavailable(f"{what}: redis at {self.url} is unavailable ({why}); "
                               f"policy stores.on_unavailable is fail_closed") from cause

    def _k(self, kind: str, key: str) -> str:
        return f"{self.prefix}{kind}:{key}"

    async def rate_limit(self, key: str, rate: float, burst: float, cost: float = 1.0) -> Decision:
        async def op() -> Decision:
            allowed, retry, tokens = await self._rate(keys=[self._k("rl", key)], args=[rate, burst, cost])
            retry_s = math.inf if float(retry) < 0 else float(retry)
            return Decision(bool(allowed), retry_s, float(tokens))

        return await self._guard(op, lambda: Decision(True, 0.0, burst, degraded=True), "rate limit")

    async def acquire_concurrency(self, key: str, limit: int, ttl_s: float = 300.0) -> Lease | None:
        zkey, token = self._k("cc", key), secrets.token_hex(8)

        async def op() -> Lease | None:
            if not await self._acquire(keys=[zkey], args=[limit, int(ttl_s * 1000), token]):
                return None

            async def release() -> None:
                await self._guard(lambda: self._redis.zrem(zkey, token), lambda: 0, "concurrency release")

            async def renew(ttl: float) -> bool:
                return bool(await self._guard(lambda: self._renew(keys=[zkey], args=[int(ttl * 1000), token]),
                                              lambda: 1, "concurrency renew"))

            return Lease(release, renew)

        return await self._guard(op, lambda: Lease(None, None, degraded=True), "concurrency")

    async def budget_consume(self, key: str, amount: int, limit: int, window_s: int,
                             *, force: bool = False) -> BudgetDecision:
        async def op() -> BudgetDecision:
            ok, used, reset = await self._budget(keys=[self._k("bg", key)],
                                                 args=[int(amount), int(limit), int(window_s), int(force)])
            return BudgetDecision(bool(ok), int(used), limit, float(reset))

        return await self._guard(op, lambda: BudgetDecision(True, 0, limit, float(window_s), degraded=True),
                                 "budget")

    async def _idem_try(self, key: str, fingerprint: str, lock_ttl_s: float) -> IdempotencyBegin:
        token = secrets.token_hex(16)

        async def op() -> IdempotencyBegin:
            reply = await self._begin(keys=[self._k("idem", key)],
                                      args=[fingerprint, token, max(1, int(lock_ttl_s * 1000))])
            state = reply[0].decode()
            if state == "mismatch":
                raise IdempotencyKeyMismatch(f"Idempotency-Key {key!r} was already used with a different request")
            if state == "completed":
                return IdempotencyBegin(IdemState.COMPLETED, response=StoredResponse.from_json(reply[1]))
            if state == "new":
                return IdempotencyBegin(IdemState.NEW, token=token)
            return IdempotencyBegin(IdemState.IN_PROGRESS)

        return await self._guard(op, lambda: IdempotencyBegin(IdemState.NEW, degraded=True), "idempotency")

    async def _idem_wait(self, key: str, timeout_s: float) -> None:
        await asyncio.sleep(min(timeout_s, self.poll_s))

    async def idempotency_complete(self, key: str, token: str | None, response: StoredResponse,
                                   ttl_s: float = 86400.0) -> bool:
        if token is None:  # began degraded: nothing was claimed
            return False

        async def op() -> bool:
            return bool(await self._complete(keys=[self._k("idem", key)],
                                             args=[token, response.to_json(), int(ttl_s * 1000)]))

        return await self._guard(op, lambda: False, "idempotency complete")

    async def idempotency_abandon(self, key: str, token: str | None) -> None:
        if token is None:
            return

        async def op() -> None:
            await self._abandon(keys=[self._k("idem", key)], args=[token])

        await self._guard(op, lambda: None, "idempotency abandon")

    async def ping(self) -> bool:
        if not self.breaker.allow():
            return False
        try:
            ok = bool(await self._redis.ping())
        except _UNAVAILABLE:
            self.breaker.failure()
            return False
        self.breaker.success()
        return ok

    async def close(self) -> None:
        await self._redis.aclose()
        await self._pool.disconnect()
