"""Hot-expert placement (which routed experts live on the fast device), pure logic, no torch.

L = MoE layers, E = routed experts per layer. Strategies: ``uniform`` (experts 0..n-1 in every layer),
``frequency`` (the n most activated per layer, or the globally most activated (layer, expert) pairs
for a total budget, from a stats file) and ``DynamicPlacement`` (decayed routing counts; proposes
bounded swaps whose benefit exceeds a threshold). NUMA assignment lives in kernels/numa.py.

Stats file (written by the engine, read here): JSON ``{"version": 1, "counts": [[c_0, ..., c_{E-1}],
... one list per layer]}`` with per-layer per-expert activation counts.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

STATS_VERSION = 1


class PlacementError(ValueError):
    """Placement inputs that cannot be satisfied (budget, stats shape, unknown strategy)."""


@dataclass(frozen=True)
class HotExpertPlan:
    """Per layer, the sorted global ids of experts kept on the fast device."""

    strategy: str
    num_experts: int
    hot: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        for layer, ids in enumerate(self.hot):
            if len(set(ids)) != len(ids) or any(not 0 <= i < self.num_experts for i in ids):
                raise PlacementError(f"layer {layer}: hot ids {ids} must be distinct and in [0, {self.num_experts})")

    def is_hot(self, layer: int, expert: int) -> bool:
        return expert in self.hot[layer]

    def cold(self, layer: int) -> tuple[int, ...]:
        hot = set(self.hot[layer])
        return tuple(e for e in range(self.num_experts) if e not in hot)

    def coverage(self, counts: list[list[float]]) -> float:
        """Fraction of routed activations in ``counts`` that this plan serves from the fast device."""
        total = sum(sum(row) for row in counts)
        served = sum(row[e] for row, ids in zip(counts, self.hot, strict=True) for e in ids)
        return served / total if total else 0.0

    def summary(self, counts: list[list[float]] | None = None) -> str:
        n = [len(ids) for ids in self.hot]
        text = (f"hot experts ({self.strategy}): {sum(n)} of {len(self.hot) * self.num_experts} "
                f"across {len(self.hot)} layers (per layer min {min(n, default=0)}, max {max(n, default=0)})")
        if counts is not None:
            text += f", covering {100 * self.coverage(counts):.1f}% of observed activations"
        return text


def plan_uniform(num_layers: int, num_experts: int, per_layer: int) -> HotExpertPlan:
    if not 0 <= per_layer <= num_experts:
        raise PlacementError(f"per_layer={per_layer} must be in [0, {num_experts}]")
    return HotExpertPlan("uniform", num_experts, tuple(tuple(range(per_layer)) for _ in range(num_layers)))


def _top(row: list[float], n: int) -> tuple[int, ...]:
    """Indices of the n largest counts; ties go to the lower id (deterministic)."""
    return tuple(sorted(sorted(range(len(row)), key=lambda e: (-row[e], e))[:n]))


def plan_frequency(counts: list[list[float]], per_layer: int | None = None,
                   total: int | None = None) -> HotExpertPlan:
    """Hottest experts: ``per_layer`` in each layer, or the ``total`` hottest (layer, expert) pairs overall."""
    if (per_layer is None) == (total is None):
        raise PlacementError("give exactly one of per_layer or total")
    num_experts = _check_counts(counts)
    if per_layer is not None:
        if not 0 <= per_layer <= num_experts:
            raise PlacementError(f"per_layer={per_layer} must be in [0, {num_experts}]")
        return HotExpertPlan("frequency", num_experts, tuple(_top(row, per_layer) for row in counts))
    assert total is not None
    if not 0 <= total <= len(counts) * num_experts:
        raise PlacementError(f"total={total} must be in [0, {len(counts) * num_experts}]")
    # Normalise per layer: every layer runs once per token, so a layer's share is what a slot saves.
    pairs = [(row[e] / (sum(row) or 1.0), layer, e) for layer, row in enumerate(counts) for e in range(len(row))]
    chosen = sorted(pairs, key=lambda p: (-p[0], p[1], p[2]))[:total]
    hot = tuple(tuple(sorted(e for _, lay, e in chosen if lay == layer)) for layer in range(len(counts)))
    return HotExpertPlan("frequency", num_experts, hot)


def _check_counts(counts: list[list[float]]) -> int:
    if not counts or not counts[0]:
        raise PlacementError("activation counts are empty")
    widths = {len(row) for row in counts}
    if len(widths) != 1:
        raise PlacementError(f"every layer needs the same number of experts, got {sorted(widths)}")
    if any(c < 0 for row in counts for c in row):
        raise PlacementError("activation counts must be non-negative")
    return widths.pop()


def load_stats(path: str | os.PathLike) -> list[list[float]]:
    data = json.loads(Path(path).read_text())
    if data.get("version") != STATS_VERSION or "counts" not in data:
        raise PlacementError(f"{path}: expected {{'version': {STATS_VERSION}, 'counts': [[...], ...]}}")
    counts = [[float(c) for c in row] for row in data["counts"]]
    _check_counts(counts)
    return counts


def save_stats(path: str | os.PathLike, counts: list[list[float]]) -> None:
    """Atomic write of the stats file the ``frequency`` strategy reads."""
    _check_counts(counts)
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps({"version": STATS_VERSION, "counts": counts}))
    os.replace(tmp, path)


@dataclass(frozen=True)
class Swap:
    layer: int
    evict: int
    admit: int
    benefit: float  # fraction of the layer's decayed activations moved to the fast device


class DynamicPlacement:
    """Decayed routing counts per (layer, expert); proposes hot-set swaps worth more than ``threshold``.

    ``observe`` multiplies all counts of the layer by ``decay`` and adds this batch's activations.
    ``propose`` pairs, per layer, the hottest cold expert with the coldest hot one while the share
    gained exceeds ``threshold``, at most ``max_swaps`` in all; ``apply`` commits them.
    """

    def __init__(self, plan: HotExpertPlan, decay: float = 0.95, threshold: float = 0.02, max_swaps: int = 2):
        if not 0.0 < decay <= 1.0 or threshold < 0 or max_swaps < 0:
            raise PlacementError("need 0 < decay <= 1, threshold >= 0, max_swaps >= 0")
        self.decay, self.threshold, self.max_swaps = decay, threshold, max_swaps
        self.num_experts = plan.num_experts
        self.hot = [set(ids) for ids in plan.hot]
        self.counts = [[0.0] * plan.num_experts for _ in plan.hot]

    def observe(self, layer: int, expert_ids: list[int]) -> None:
        """Record one batch of routed expert ids for ``layer`` (-1 entries are ignored)."""
        row = self.counts[layer]
        for e in range(len(row)):
            row[e] *= self.decay
        for e in expert_ids:
            if e >= 0:
                row[e] += 1.0

    def observe_counts(self, layer: int, counts: list[float]) -> None:
        """Record activation counts per expert for ``layer`` (one interval's routing, aggregated)."""
        row = self.counts[layer]
        if len(counts) != len(row):
            raise PlacementError(f"layer {layer}: expected {len(row)} counts, got {len(counts)}")
        for e, c in enumerate(counts):
            row[e] = row[e] * self.decay + c

    def propose(self) -> list[Swap]:
        candidates: list[Swap] = []
        for layer, (row, hot) in enumerate(zip(self.counts, self.hot, strict=True)):
            total = sum(row) or 1.0
            cold = sorted((e for e in range(len(row)) if e not in hot), key=lambda e: (-row[e], e))
            warm = sorted(hot, key=lambda e: (row[e], e))
            for admit, evict in zip(cold, warm, strict=False):
                benefit = (row[admit] - row[evict]) / total
                if benefit <= self.threshold:
                    break
                candidates.append(Swap(layer, evict, admit, benefit))
        candidates.sort(key=lambda s: (-s.benefit, s.layer, s.admit))
        return candidates[: self.max_swaps]

    def apply(self, swaps: list[Swap]) -> None:
        for s in swaps:
            if s.evict not in self.hot[s.layer] or s.admit in self.hot[s.layer]:
                raise PlacementError(f"stale swap {s}: re-run propose()")
            self.hot[s.layer].remove(s.evict)
            self.hot[s.layer].add(s.admit)

    def plan(self) -> HotExpertPlan:
        return HotExpertPlan("dynamic", self.num_experts, tuple(tuple(sorted(h)) for h in self.hot))
