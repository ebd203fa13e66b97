"""Routed experts streamed from the checkpoint straight into packed shards in host memory.

One expert at a time: the loader reads an expert's gate/up/down weights (in the model dtype, as the
full-precision model would hold them), a background pool quantizes it into every format its layer's
shards need and writes it into that shard's preallocated slot, and the full-precision copy is dropped.
At most `2 x workers` experts are in flight, so peak memory is the packed size plus that working set,
never a full-precision copy of all experts. Packing an expert alone gives the same bytes as packing it
in a batch (every format quantizes per expert and output row), so the shards are bit-identical to
packing the materialised model.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch
from tqdm.auto import tqdm

from engine.experts import ExpertShard, LayerExperts, LayerPlan, ShardSpec
from kernels import PackCache, PackedExperts, pack_experts
from kernels.formats import SILU, Activation
from kernels.hugepages import hugepage_copy

log = logging.getLogger(__name__)

# reads (layer, expert) -> (gate_up [2I, H], down [H, I]) on the CPU in the model dtype, then for biased
# experts (gate_up bias [2I], down bias [H])
ExpertReader = Callable[[int, int], tuple[torch.Tensor, ...]]


def default_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))


class _ShardBuffer:
    """The packed tensors of one shard, filled one expert slot at a time (from any pool thread)."""

    def __init__(self, spec: ShardSpec) -> None:
        self.spec = spec
        self.slot = {e: k for k, e in enumerate(spec.expert_ids)}
        self.tensors: dict[str, torch.Tensor] | None = None
        self.meta: tuple | None = None  # hidden, intermediate, group size
        self.filled = 0
        self.lock = threading.Lock()

    def put(self, expert: int, one: PackedExperts) -> None:
        with self.lock:
            if self.tensors is None:  # shapes known from the first packed expert; huge pages as the kernel wants
                n = len(self.spec.expert_ids)
                self.tensors = {k: hugepage_copy(torch.empty((n, *t.shape[1:]), dtype=t.dtype)) if t.numel() else t
                                for k, t in one.tensors.items()}
                self.meta = (one.hidden, one.intermediate, one.group_size, one.act)
        k = self.slot[expert]
        for name, t in one.tensors.items():
            if t.numel():
                self.tensors[name][k].copy_(t[0])
        with self.lock:
            self.filled += 1

    def finish(self) -> PackedExperts:
        assert self.tensors is not None and self.meta is not None and self.filled == len(self.slot)
        hidden, inter, gs, act = self.meta
        return PackedExperts(self.spec.fmt, hidden, inter, gs, self.spec.expert_ids, self.tensors, act)


def _pack_one(expert: int, weights: tuple[torch.Tensor, ...], targets: list[_ShardBuffer], bar: tqdm,
              act: Activation) -> None:
    gate_up, down, *bias = weights
    biases = (bias[0][None], bias[1][None]) if bias else None
    by_fmt: dict[str, PackedExperts] = {}
    for buf in targets:
        fmt = buf.spec.fmt
        if fmt not in by_fmt:  # [1, 2I, H], [1, H, I] -> one packed expert per format
            by_fmt[fmt] = pack_experts(gate_up[None], down[None], fmt, progress=False, biases=biases, act=act)
        buf.put(expert, by_fmt[fmt])
    bar.update(1)


def _cache_key(cache: PackCache, layer: int, spec: ShardSpec, source: str, hidden: int, inter: int) -> str:
    """The pack cache's key for a shard (the same key PackCache.get_or_pack gives those weights)."""
    n = len(spec.expert_ids)
    shapes = f"{(n, 2 * inter, hidden)}x{(n, hidden, inter)}"
    shapes += "|ids" + hashlib.sha256(repr(tuple(spec.expert_ids)).encode()).hexdigest()[:12]
    return cache.key(f"layer{layer}", source, spec.fmt, None, shapes)


def stream_experts(
    read: ExpertReader,
    plans: dict[int, LayerPlan],
    hidden: int,
    intermediate: int,
    *,
    cache_dir: str | None = None,
    source: str = "",
    workers: int | None = None,
    progress: bool = True,
    act: Activation = SILU,
) -> dict[int, LayerExperts]:
    """Packs every MoE layer's shards from `read`, one expert at a time in a pool of `workers` threads.

    With `cache_dir` a shard found in the pack cache (keyed by `source`, which must identify the
    checkpoint and the model dtype) is loaded instead, and its experts are not read at all when no
    other shard of the layer needs them; freshly packed shards are stored there.
    """
    cache = PackCache(cache_dir) if cache_dir else None
    built: dict[tuple[int, ShardSpec], PackedExperts] = {}
    todo: list[tuple[int, _ShardBuffer]] = []
    for i, plan in plans.items():
        for spec in plan.shards:
            packed = cache.load(_cache_key(cache, i, spec, source, hidden, intermediate), f"layer{i}") if cache else None
            if packed is not None:
                cache.hits += 1
                built[(i, spec)] = packed
            else:
                if cache is not None:
                    cache.misses += 1
                todo.append((i, _ShardBuffer(spec)))
    jobs: list[tuple[int, int, list[_ShardBuffer]]] = []  # (layer, expert, shards it goes into)
    for i in plans:
        bufs = [b for j, b in todo if j == i]
        for e in sorted({e for b in bufs for e in b.spec.expert_ids}):
            jobs.append((i, e, [b for b in bufs if e in b.slot]))
    fmts = sorted({b.spec.fmt for _, b in todo})
    bar = tqdm(total=len(jobs), desc=f"stream experts ({', '.join(fmts) or 'cached'})", unit="expert",
               disable=not progress or not jobs)
    workers = workers or default_workers()
    in_flight = threading.BoundedSemaphore(2 * workers)
    futures: list[Future] = []
    with ThreadPoolExecutor(workers, thread_name_prefix="moegate-pack") as pool:
        try:
            for i, e, targets in jobs:
                in_flight.acquire()
                failed = [f for f in futures if f.done() and f.exception() is not None]
                if failed:
                    in_flight.release()
                    break
                try:
                    weights = read(i, e)
                    fut = pool.submit(_pack_one, e, weights, targets, bar, act)
                except BaseException:
                    in_flight.release()
                    raise
                fut.add_done_callback(lambda _f: in_flight.release())
                futures.append(fut)
                del weights  # the pool holds the only reference: freed as soon as it is packed
        except BaseException:
            for f in futures:
                f.cancel()
            raise
        wait(futures)
    errors = [f.exception() for f in futures if not f.cancelled() and f.exception() is not None]
    if errors:
        raise errors[0]
    bar.close()
    for i, buf in todo:
        packed = buf.finish()
        built[(i, buf.spec)] = packed
        if cache is not None:
            cache.store(_cache_key(cache, i, buf.spec, source, hidden, intermediate), f"layer{i}", packed)
    if cache is not None:
        log.info("pack cache %s: %d shard(s) loaded, %d packed", cache_dir, cache.hits, cache.misses)
    layers = {}
    on_device: dict[tuple[int, ShardSpec], ExpertShard] = {}
    for i, plan in plans.items():
        def shard(spec: ShardSpec, i=i) -> ExpertShard:
            if (i, spec) not in on_device:
                packed = built[(i, spec)]
                device = torch.device(spec.device)
                on_device[(i, spec)] = ExpertShard(packed.to(device) if spec.hot else packed, device)
            return on_device[(i, spec)]

        n = sum(len(s.expert_ids) for s in plan.fast)
        layers[i] = LayerExperts([shard(s) for s in plan.fast], [shard(s) for s in plan.exact],
                                 counts=torch.zeros(n, dtype=torch.long))
    return layers
