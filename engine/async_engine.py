"""AsyncLLM: the engine loop on its own thread, one asyncio stream of RequestOutputs per request."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator
from concurrent.futures import Future
from dataclasses import asdict, dataclass

from engine.errors import EngineError
from engine.llm_engine import EngineConfig, LLMEngine, RequestOutput
from engine.mode import Mode
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(EngineError):
    """The engine loop stopped after an internal failure; the server should be restarted."""


class _Delivery:
    """Hands items from the engine thread to one event loop: one wake-up of the loop (a write to its self-pipe,
    and the GIL hand-off that comes with it) per batch of items, not per item. Items posted while a delivery is
    pending join it, so a step's outputs for every stream on the loop arrive together, each stream's in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)  # AsyncLLM keys its deliveries weakly by loop: no strong ref back
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.Queue, RequestOutput | BaseException]] = []

    def post(self, queue_: asyncio.Queue, item: RequestOutput | BaseException) -> None:
        with self._lock:
            self._items.append((queue_, item))
            wake = len(self._items) == 1  # else a delivery is already scheduled and takes this item too
        if wake:
            loop = self._loop()
            try:
                if loop is None:
                    raise RuntimeError("the stream's event loop is gone")
                loop.call_soon_threadsafe(self._deliver)
            except RuntimeError:  # a closed loop: nothing will read these; the next post tries to wake it again
                with self._lock:
                    self._items.clear()
                raise

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for queue_, item in items:
            queue_.put_nowait(item)


@dataclass
class _Stream:
    delivery: _Delivery
    queue: asyncio.Queue
    final_only: bool = False  # the caller reads only the finished output: no per-step delivery

    def put(self, item: RequestOutput | BaseException) -> None:
        self.delivery.post(self.queue, item)


@dataclass
class StepStats:
    """Engine steps since start, counted on the loop thread: how many, the sequences and tokens they output, the
    wall time inside `step()` and the loop thread's CPU time in it (wall minus CPU: the thread waited for a core or
    for the interpreter lock, which work on the event loop holds), and the time the loop waited with no work."""

    steps: int = 0
    sequences: int = 0
    tokens: int = 0
    wall_seconds: float = 0.0
    thread_cpu_seconds: float = 0.0
    idle_seconds: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


class AsyncLLM:
    """Thread-safe front of an LLMEngine. Commands go in through a queue; the loop thread owns the engine."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._deliveries: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> _Delivery
        self._stop = threading.Event()
        self._dead: BaseException | None = None
        self.step_stats = StepStats()  # written by the loop thread only; read at any time (monotonic counters)
        self._thread = threading.Thread(target=self._run, name="moegate-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLM:
        return cls(LLMEngine(config))

    @property
    def num_active(self) -> int:
        return len(self._streams)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, mode: Mode = Mode.EXPLORATION,
        *, cache_salt: str = "", final_only: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Yields incremental outputs until the request finishes; closing the iterator aborts it.

        `cache_salt` (the tenant, set by the server) scopes prefix-cache reuse; see LLMEngine.add_request.
        `final_only`: yield only the finished output (its text and token ids are whole), for a caller that reads
        nothing before the end: the event loop is then not woken for the request at every step.
        """
        if self._dead is not None:
            raise EngineDeadError(f"engine stopped: {self._dead}")
        loop = asyncio.get_running_loop()
        delivery = self._deliveries.get(loop)
        if delivery is None:
            delivery = self._deliveries[loop] = _Delivery(loop)
        stream = _Stream(delivery, asyncio.Queue(), final_only)
        self._streams[request_id] = stream
        self._commands.put(("add", request_id, prompt_token_ids, params, mode, cache_salt))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._commands.put(("abort", request_id))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def set_mode(self, request_id: str, mode: Mode, resync: str = "keep") -> None:
        """Switches the request to `mode` before its next token (applied on the engine thread)."""
        self._commands.put(("mode", request_id, mode, resync))

    def set_deferral(self, defer: int) -> Future:
        """Changes exploration's expert deferral between two steps (LLMEngine.set_deferral, on the engine
        thread); the future completes when applied (or holds the ValueError)."""
        done: Future = Future()
        self._commands.put(("defer", defer, done))
        return done

    def numerics_fingerprint(self, mode: Mode = Mode.EXECUTION) -> str:
        return self.engine.numerics_fingerprint(mode)

    def cache_stats(self) -> dict[str, dict[str, int]]:
        """Per-tier prefix cache counters (read from the loop thread's counters; for /metrics)."""
        return self.engine.cache_stats()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put(("wake",))
        self._thread.join(timeout)
        self.engine.runner.shutdown()
        self.engine.close()  # cached KV to the durable tiers

    # -- loop thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        stats = self.step_stats
        while not self._stop.is_set():
            block = not self.engine.has_work()
            try:
                t = time.perf_counter()
                self._drain(block)
                if block:
                    stats.idle_seconds += time.perf_counter() - t
                if self.engine.has_work():
                    t, cpu = time.perf_counter(), time.thread_time()
                    outs = self.engine.step()
                    stats.wall_seconds += time.perf_counter() - t
                    stats.thread_cpu_seconds += time.thread_time() - cpu
                    stats.steps += 1
                    stats.sequences += len(outs)
                    for out in outs:
                        stats.tokens += len(out.new_token_ids)
                        stream = self._streams.get(out.request_id)
                        if stream is not None and (out.finished or out.error or not stream.final_only):
                            stream.put(EngineError(out.error) if out.error else out)
            except Exception as exc:  # noqa: BLE001 - a broken step must fail its requests, not hang them
                log.exception("engine step failed")
                self._fail_all(exc)

    def _drain(self, block: bool) -> None:
        while block or not self._commands.empty():  # between busy steps: no get() raising Empty
            try:
                cmd = self._commands.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if cmd[0] == "add":
                _, rid, ids, params, mode, salt = cmd
                try:
                    self.engine.add_request(rid, ids, params, mode=mode, cache_salt=salt)
                except Exception as exc:  # noqa: BLE001 - reported to that request only
                    stream = self._streams.get(rid)
                    if stream is not None:
                        stream.put(exc)
            elif cmd[0] == "abort":
                self.engine.abort(cmd[1])
            elif cmd[0] == "mode":
                self.engine.set_mode(cmd[1], cmd[2], cmd[3])
            elif cmd[0] == "defer":
                try:
                    self.engine.set_deferral(cmd[1])
                except Exception as exc:  # noqa: BLE001 - reported to the caller's future
                    cmd[2].set_exception(exc)
                else:
                    cmd[2].set_result(None)

    def _fail_all(self, exc: BaseException) -> None:
        """Fails every in-flight request with the error and frees their state; the loop keeps serving."""
        for rid in self.engine.active_request_ids():
            self.engine.abort(rid)
            stream = self._streams.get(rid)
            if stream is not None:
                stream.put(EngineError(f"engine step failed: {exc}"))
