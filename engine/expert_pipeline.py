"""Routed experts in host memory, computed for a model whose dense part runs on a fast device.

T = tokens, R = tokens routed to at least one host-held expert, H = hidden, K = experts per token.

`run` computes a layer's experts now, on the calling thread; `submit` hands them to the expert
thread and returns at once (expert deferral: the caller runs the next layer's attention on the fast
device meanwhile and collects the result at the next MoE layer). Both take the same path:

1. stage (calling thread): only the R routed rows of x, ids and weights are copied to the host,
   into pinned buffers with non-blocking copies when the fast device is CUDA, and an event is
   recorded after them; where the fast device is the CPU the copies are no-ops;
2. compute (calling thread or expert thread): wait for the event, run the CPU kernel on every
   host shard of the profile in a fixed order;
3. land: the [R, H] result goes back to the fast device (pinned, non-blocking), is scattered into
   [T, H], and the shards on the fast device (hot experts) are added.

A failure in the expert thread surfaces as `ExpertWorkerError` where the result is collected;
`abort()` cancels queued work and waits for the running job, so nothing from an abandoned forward
leaks into the next one.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

import torch

from engine.errors import EngineError

log = logging.getLogger(__name__)


class ExpertWorkerError(EngineError):
    """Routed-expert work in the expert thread failed or was aborted."""


@dataclass
class _Staged:
    x: torch.Tensor  # [R, H] on the host
    ids: torch.Tensor  # [R, K]
    weights: torch.Tensor  # [R, K]
    rows: torch.Tensor | None  # [R] rows of the batch on the fast device; None: all T rows
    num_tokens: int
    ready: torch.cuda.Event | None  # recorded after the host copies (CUDA only)


class ExpertPipeline:
    """Stages, computes and lands routed-expert work for a model on `device`; `worker`: an expert thread."""

    def __init__(self, device: torch.device | str, worker: bool = False) -> None:
        self.device = torch.device(device)
        self.pinned = self.device.type == "cuda"
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="moegate-experts") if worker else None
        self._in_flight: set[Future] = set()
        self._aborted = threading.Event()
        self.layerwise = None  # engine.layerwise_prefill.LayerwisePrefill: long exploration bursts on the fast device

    # -- public ---------------------------------------------------------------------------------
    def start_worker(self) -> ThreadPoolExecutor:
        """The expert thread, started if this pipeline has none yet (deferral switched on at run time)."""
        if self.executor is None:
            self.executor = ThreadPoolExecutor(1, thread_name_prefix="moegate-experts")
        return self.executor

    def run(self, experts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, exact: bool = False,
            num_threads: int | None = None) -> torch.Tensor:
        """x [T, H], ids [T, K] (-1 = skip), weights [T, K] -> [T, H] in x's dtype, computed now."""
        if experts.packed is None:
            return experts.reference(x, ids, weights)
        if self.layerwise is not None and self.layerwise.applies(experts.packed, x.shape[0], exact):
            out = self.layerwise.compute(experts.packed, x, ids, weights)  # host-held experts, on the fast device
            hot = experts.packed.compute_device(x, ids, weights, exact)
            return (out if hot is None else out + hot).to(x.dtype)
        staged = self._stage(experts.packed, x, ids, weights, exact)
        return self._land(experts.packed, x, ids, weights, exact,
                          self._compute(staged.x, staged.ids, staged.weights, experts.packed, exact, num_threads,
                                        staged.ready), staged)

    def submit(self, experts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, exact: bool = False,
               num_threads: int | None = 1) -> Deferred:
        """Like `run`, but computed in the expert thread; `.result()` gives the [T, H] output."""
        if self.executor is None:
            raise RuntimeError("this ExpertPipeline has no expert thread (worker=False)")
        self._aborted.clear()
        if experts.packed is None:
            fut = self.executor.submit(self._guard(experts.reference), x, ids, weights)
            self._in_flight.add(fut)
            return Deferred(self, fut, None, x, ids, weights, exact, None)
        staged = self._stage(experts.packed, x, ids, weights, exact)
        fut = self.executor.submit(self._guard(self._compute), staged.x, staged.ids, staged.weights,
                                   experts.packed, exact, num_threads, staged.ready)
        self._in_flight.add(fut)
        return Deferred(self, fut, experts.packed, x, ids, weights, exact, staged)

    def abort(self) -> None:
        """Cancels queued expert work and waits for the running job (its result is dropped)."""
        self._aborted.set()
        if self.layerwise is not None:
            self.layerwise.reset()
        pending = list(self._in_flight)
        for fut in pending:
            fut.cancel()
        wait_futures(pending)
        self._in_flight.clear()
        if pending:
            log.info("expert pipeline: %d deferred job(s) aborted", len(pending))

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def shutdown(self) -> None:
        if self.layerwise is not None:
            self.layerwise.close()
        if self.executor is not None:
            self.abort()
            self.executor.shutdown(wait=True)

    # -- the three steps ------------------------------------------------------------------------
    def _guard(self, fn):
        def guarded(*args):
            if self._aborted.is_set():
                raise CancelledError("expert pipeline aborted")
            return fn(*args)

        return guarded

    def _stage(self, layer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, exact: bool) -> _Staged:
        t = x.shape[0]
        if layer.all_on_host(exact):
            routed = (ids >= 0).any(dim=1)  # [T]
        else:
            host = layer.host_experts(exact).to(ids.device)  # [E] bool: experts held in host memory
            routed = ((ids >= 0) & host[ids.clamp(min=0)]).any(dim=1)  # [T]
        rows = None if bool(routed.all()) else routed.nonzero().squeeze(1)  # [R]
        xs, ids_s, ws = (x, ids, weights) if rows is None else (x[rows], ids[rows], weights[rows])
        ready = None
        if self.device.type != "cpu":
            xs, ids_s, ws = (self._to_host(v) for v in (xs, ids_s, ws))
            if self.device.type == "cuda":
                ready = torch.cuda.Event()
                ready.record()
        return _Staged(xs, ids_s, ws, rows, t, ready)

    def _to_host(self, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty(v.shape, dtype=v.dtype, pin_memory=self.pinned)
        out.copy_(v, non_blocking=self.pinned)
        return out

    @staticmethod
    def _compute(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, layer, exact: bool,
                 num_threads: int | None, ready) -> torch.Tensor | None:
        """The host shards' CPU kernels over the staged rows -> [R, H] fp32 on the host (None: no host shard)."""
        if ready is not None:
            ready.synchronize()
        return layer.compute_host(x, ids, weights, exact, num_threads)

    def _land(self, layer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, exact: bool,
              y: torch.Tensor | None, staged: _Staged) -> torch.Tensor:
        """Host result [R, H] -> [T, H] on the fast device, plus the fast device's own (hot) shards."""
        out = layer.compute_device(x, ids, weights, exact)  # [T, H] fp32 or None
        if y is not None:
            if self.device.type != "cpu":
                if self.pinned:
                    y = y.pin_memory()
                y = y.to(self.device, non_blocking=self.pinned)
            if staged.rows is not None:
                y = torch.zeros(staged.num_tokens, y.shape[1], dtype=y.dtype, device=self.device).index_copy_(
                    0, staged.rows, y)
            out = y if out is None else out + y
        if out is None:
            out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        return out.to(x.dtype)


class Deferred:
    """Routed-expert output still being computed in the expert thread."""

    def __init__(self, pipeline: ExpertPipeline, fut: Future, layer, x, ids, weights, exact, staged) -> None:
        self.pipeline, self.future, self.layer = pipeline, fut, layer
        self._args = (x, ids, weights, exact)
        self.staged = staged

    def result(self) -> torch.Tensor:
        """The [T, H] output on the fast device; raises ExpertWorkerError if the work failed or was aborted."""
        try:
            y = self.future.result()
        except CancelledError as exc:
            raise ExpertWorkerError("deferred expert work was aborted") from exc
        except Exception as exc:
            raise ExpertWorkerError(f"deferred expert work failed in the expert thread: {exc}") from exc
        finally:
            self.pipeline._in_flight.discard(self.future)
        if self.layer is None:  # unpacked experts: computed on the fast device already
            return y
        return self.pipeline._land(self.layer, *self._args, y, self.staged)
