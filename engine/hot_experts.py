"""The hot set follows the traffic: routing counts gathered while serving, swaps packed in the background
and applied between engine steps, without stopping the traffic.

Each MoE layer's exploration profile has two shards when the hot set is dynamic (engine/experts.py):
the *upper* one (hot experts on the fast device, or the most-routed experts kept at the exact format in
host memory) and the *lower* one (the rest, in the fast format). Every `interval_steps` engine steps the
counts routed since the last look feed a `DynamicPlacement` (decayed counts); the swaps it proposes are
packed on a background thread straight from the checkpoint (the admitted expert in the upper shard's
format and device, the evicted one in the lower shard's format), and applied between two steps by
copying the one-expert slots in place and relabelling the shards. Execution never reads these shards
(its profile has static shards of its own), so only exploration's numerics change: each applied batch
of swaps bumps `version`, which enters exploration's numerics fingerprint.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import torch

from engine.experts import DynamicHotConfig, ExpertShard, LayerExperts
from kernels import PackedExperts, pack_experts
from kernels.placement import DynamicPlacement, HotExpertPlan, Swap

log = logging.getLogger(__name__)

ExpertReader = Callable[[int, int], tuple[torch.Tensor, ...]]  # (layer, expert) -> gate_up, down[, biases]


@dataclass
class _Tier:
    layer: int  # model layer index
    upper: ExpertShard
    lower: ExpertShard


def _tiers(layers: dict[int, LayerExperts]) -> list[_Tier]:
    tiers = []
    for i in sorted(layers):
        le = layers[i]
        if len(le.fast) != 2:
            raise ValueError(f"layer {i}: a dynamic hot set needs an upper and a lower shard in the exploration "
                             f"profile, found {[s.label for s in le.fast]}")
        upper, lower = le.fast
        if any(s is upper or s is lower for s in le.exact):
            raise ValueError(f"layer {i}: the execution profile shares a shard with the dynamic hot set")
        tiers.append(_Tier(i, upper, lower))
    return tiers


def _pack_one(read: ExpertReader, layer: int, expert: int, like: ExpertShard) -> PackedExperts:
    gate_up, down, *bias = read(layer, expert)  # biases too where the family has them (GPT-OSS)
    p = like.packed
    one = pack_experts(gate_up[None], down[None], p.fmt, group_size=p.group_size or None, progress=False,
                       biases=(bias[0][None], bias[1][None]) if bias else None, act=p.act)
    return one.to(like.device) if like.device.type != "cpu" else one


class HotSetUpdater:
    """Owns the dynamic hot set of every MoE layer: `between_steps()` is called by the engine thread."""

    def __init__(self, layers: dict[int, LayerExperts], read: ExpertReader, config: DynamicHotConfig) -> None:
        self.config = config
        self.read = read
        self.layers = layers
        self.tiers = _tiers(layers)
        n = layers[self.tiers[0].layer].counts.numel() if self.tiers else 0
        plan = HotExpertPlan("dynamic", n, tuple(tuple(sorted(t.upper.packed.expert_ids)) for t in self.tiers))
        self.placement = DynamicPlacement(plan, decay=config.decay, threshold=config.threshold,
                                          max_swaps=config.max_swaps)
        self._last = [layers[t.layer].counts.clone() for t in self.tiers]
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="moegate-hotset")
        self._pending: list[tuple[Swap, Future]] = []
        self._lock = threading.Lock()
        self.steps = 0
        self.version = 0
        self.swaps_applied = 0
        self.routed = 0  # routed activations seen at interval boundaries
        self.routed_upper = 0  # of them, served by the upper shard

    @classmethod
    def build(cls, layers: dict[int, LayerExperts], placement, read: ExpertReader,
              device: torch.device) -> HotSetUpdater | None:
        """The engine's updater when `placement` asks for a dynamic hot set and the layers have a faster tier."""
        if placement is None or not placement.dynamic_hot or not layers:
            return None
        if not all(len(le.fast) == 2 for le in layers.values()):  # hot experts on the GPU asked for, none here
            log.info("dynamic hot set: no faster tier on %s (GPU hot experts need CUDA); the hot set is off", device)
            return None
        return cls(layers, read, placement.dynamic)

    # -- the engine thread ---------------------------------------------------------------------
    def between_steps(self) -> bool:
        """Applies finished swaps and, every `interval_steps`, proposes new ones. True when the hot set changed."""
        self.steps += 1
        changed = self._apply_ready()
        if self.steps % self.config.interval_steps == 0 and not self._pending:
            self._observe()
            for swap in self.placement.propose():
                tier = self.tiers[swap.layer]
                fut = self._pool.submit(self._prepare, tier, swap)
                self._pending.append((swap, fut))
        return changed

    def _observe(self) -> None:
        for j, t in enumerate(self.tiers):
            counts = self.layers[t.layer].counts
            delta = counts - self._last[j]
            self._last[j] = counts.clone()
            self.routed += int(delta.sum())
            self.routed_upper += int(delta[list(t.upper.packed.expert_ids)].sum())
            self.placement.observe_counts(j, delta.double().tolist())

    def _prepare(self, tier: _Tier, swap: Swap) -> tuple[PackedExperts, PackedExperts]:
        return (_pack_one(self.read, tier.layer, swap.admit, tier.upper),
                _pack_one(self.read, tier.layer, swap.evict, tier.lower))

    def _apply_ready(self) -> bool:
        if not self._pending or not all(f.done() for _, f in self._pending):
            return False
        pending, self._pending = self._pending, []
        applied = []
        for swap, fut in pending:
            try:
                admit, evict = fut.result()
            except Exception:  # a failed read must not stop serving: the hot set stays as it is
                log.exception("hot set: packing the swap %s failed; the swap is dropped", swap)
                continue
            self._swap(self.tiers[swap.layer], swap, admit, evict)
            applied.append(swap)
        if not applied:
            return False
        self.placement.apply(applied)
        self.version += 1
        self.swaps_applied += len(applied)
        log.info("hot set v%d: %s", self.version,
                 ", ".join(f"layer {self.tiers[s.layer].layer}: {s.evict}->{s.admit} (+{s.benefit:.1%})" for s in applied))
        return True

    def _swap(self, tier: _Tier, swap: Swap, admit: PackedExperts, evict: PackedExperts) -> None:
        up, low = tier.upper.packed, tier.lower.packed
        su, sl = up.local_index(swap.evict), low.local_index(swap.admit)
        for name, t in admit.tensors.items():
            if t.numel():
                up.tensors[name][su].copy_(t[0])
        for name, t in evict.tensors.items():
            if t.numel():
                low.tensors[name][sl].copy_(t[0])
        up_ids = tuple(swap.admit if e == swap.evict else e for e in up.expert_ids)
        low_ids = tuple(swap.evict if e == swap.admit else e for e in low.expert_ids)
        tier.upper.packed = replace(up, expert_ids=up_ids)  # the same tensors, relabelled
        tier.lower.packed = replace(low, expert_ids=low_ids)
        le = self.layers[tier.layer]
        for key in ("_host_fast", "_host_exact"):  # which experts are computed on the host changed
            le.__dict__.pop(key, None)

    # -- reporting -----------------------------------------------------------------------------
    def digest(self) -> str:
        """Names the current hot set (enters exploration's numerics fingerprint)."""
        ids = [t.upper.packed.expert_ids for t in self.tiers]
        return hashlib.sha256(repr(ids).encode()).hexdigest()[:16]

    def stats(self) -> dict[str, float | int]:
        return {
            "version": self.version,
            "swaps": self.swaps_applied,
            "pending": len(self._pending),
            "hit_rate": self.routed_upper / self.routed if self.routed else 0.0,
        }

    def drain(self, timeout: float | None = None) -> None:
        """Waits for swaps being packed (tests, shutdown)."""
        for _, fut in list(self._pending):
            fut.result(timeout)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
