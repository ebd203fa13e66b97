"""Routed-expert placement and precision: each MoE layer's experts as shards of packed weights.

A shard is a subset of a layer's experts in one format on one device. A *profile* is a list of
shards covering every expert exactly once. Each layer has a `fast` profile (exploration) and an
`exact` profile (execution); on the "formatting layers" they differ (e.g. int4 vs bf16), elsewhere
they are the same object. Hot experts (on the fast device) and mixed precision by routing frequency
are both just more shards. `plan_layers` decides the shards (`ShardSpec`: format, experts, device)
before loading; the loader packs them while streaming the checkpoint (engine/expert_stream.py), once,
so switching profiles costs nothing. `LayerExperts` computes the host shards (CPU kernel) and the
fast device's shards separately, for engine/expert_pipeline.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kernels import PackedExperts, formats_for, fused_moe, save_stats
from kernels.placement import plan_frequency, plan_uniform

log = logging.getLogger(__name__)

EXPERT_FORMATS = formats_for("experts")


@dataclass(frozen=True)
class DynamicHotConfig:
    """How the hot set follows the traffic (`hot_strategy="dynamic"`, engine/hot_experts.py): every
    `interval_steps` engine steps the decayed routing counts propose at most `max_swaps` swaps, each
    worth more than `threshold` of its layer's activations; packed in the background, applied between steps."""

    interval_steps: int = 64
    decay: float = 0.95  # per interval
    threshold: float = 0.02
    max_swaps: int = 2

    def __post_init__(self) -> None:
        if self.interval_steps < 1 or not 0.0 < self.decay <= 1.0 or self.threshold < 0 or self.max_swaps < 1:
            raise ValueError("dynamic hot set needs interval_steps >= 1, 0 < decay <= 1, threshold >= 0, "
                             "max_swaps >= 1")


@dataclass(frozen=True)
class PlacementConfig:
    """How routed experts are stored and where they run; normalised once, logged at start."""

    fast_format: str = "bf16"  # exploration profile of every MoE layer
    exact_format: str = "bf16"  # execution profile of the formatting layers
    formatting_layers: int = 0  # last N MoE layers use exact_format in execution mode
    execution_format: str | None = None  # execution profile of the other layers (None: fast_format)
    mixed_hot_fraction: float = 0.0  # share of most-routed experts kept at mixed_format in the fast profile
    mixed_format: str | None = None  # format of those experts (None: exact_format)
    hot_experts: int = 0  # experts per layer resident on the fast device (CUDA only)
    hot_strategy: str = "uniform"  # uniform | frequency | dynamic (frequency or uniform at start, then follows traffic)
    dynamic: DynamicHotConfig = field(default_factory=DynamicHotConfig)  # with hot_strategy="dynamic"
    stats_file: str | None = None  # routing counts (JSON) for `frequency` and mixed precision
    pack_cache_dir: str | None = None  # where packed experts are cached; None: no cache

    def __post_init__(self) -> None:
        for name in ("fast_format", "exact_format", "execution_format", "mixed_format"):
            if name in ("execution_format", "mixed_format") and getattr(self, name) is None:
                continue
            if getattr(self, name) not in EXPERT_FORMATS:
                raise ValueError(f"{name} must be one of {EXPERT_FORMATS}, got {getattr(self, name)!r}")
        if self.formatting_layers < 0 or self.hot_experts < 0:
            raise ValueError("formatting_layers and hot_experts must be >= 0")
        if not 0.0 <= self.mixed_hot_fraction <= 1.0:
            raise ValueError(f"mixed_hot_fraction must be in [0, 1], got {self.mixed_hot_fraction}")
        if self.hot_strategy not in ("uniform", "frequency", "dynamic"):
            raise ValueError(f"hot_strategy must be uniform, frequency or dynamic, got {self.hot_strategy!r}")
        if self.hot_strategy == "frequency" and not self.stats_file:
            raise ValueError("frequency placement needs stats_file (routing counts)")
        if self.mixed_hot_fraction and not (self.stats_file or self.dynamic_hot):
            raise ValueError("mixed precision needs stats_file (routing counts) or hot_strategy=dynamic")
        if self.dynamic_hot and self.hot_experts and self.mixed_hot_fraction:
            raise ValueError("a dynamic hot set is either hot_experts on the GPU or mixed_hot_fraction, not both")
        if self.dynamic_hot and not (self.hot_experts or self.mixed_hot_fraction):
            raise ValueError("hot_strategy=dynamic needs hot_experts (GPU) or mixed_hot_fraction > 0")

    @property
    def dynamic_hot(self) -> bool:
        return self.hot_strategy == "dynamic"

    def describe(self) -> str:
        parts = [f"experts {self.fast_format}"]
        if self.execution_format and self.execution_format != self.fast_format:
            parts.append(f"execution: experts {self.execution_format}")
        if self.formatting_layers:
            parts.append(f"execution: last {self.formatting_layers} MoE layers {self.exact_format}")
        if self.mixed_hot_fraction:
            parts.append(f"top {self.mixed_hot_fraction:.0%} most-routed experts {self.mixed_format or self.exact_format}")
        if self.hot_experts:
            parts.append(f"{self.hot_experts} hot experts/layer on the fast device ({self.hot_strategy})")
        if self.dynamic_hot:
            d = self.dynamic
            parts.append(f"hot set follows routing (every {d.interval_steps} steps, <= {d.max_swaps} swaps, "
                         f"threshold {d.threshold:.0%}); execution keeps its own static shards")
        return "; ".join(parts)


@dataclass(frozen=True)
class ShardSpec:
    """One shard to build: these experts of a layer, packed in `fmt`, resident on `device`."""

    fmt: str
    expert_ids: tuple[int, ...]
    device: str  # "cpu" (host memory) or the fast device ("cuda", "cuda:1")

    @property
    def hot(self) -> bool:
        return self.device != "cpu"


@dataclass(frozen=True)
class LayerPlan:
    """The shards of one MoE layer under both profiles (`exact` is `fast` where they agree)."""

    fast: tuple[ShardSpec, ...]
    exact: tuple[ShardSpec, ...]

    @property
    def shards(self) -> tuple[ShardSpec, ...]:
        """Every distinct shard the layer holds, fast profile first."""
        return self.fast + tuple(s for s in self.exact if s not in self.fast)


def plan_layers(cfg, placement: PlacementConfig, fast_device: torch.device,
                stats: list[list[float]] | None = None) -> dict[int, LayerPlan]:
    """Which experts of each MoE layer go into which shard (format, device) under both profiles."""
    moe_layers = [i for i, m in enumerate(cfg.moe_layers) if m]
    n = cfg.num_experts
    if stats is not None and (len(stats) != len(moe_layers) or any(len(r) != n for r in stats)):
        raise ValueError(f"{placement.stats_file}: expected counts for {len(moe_layers)} MoE layers x {n} experts")
    formatting = set(moe_layers[max(0, len(moe_layers) - placement.formatting_layers) :])
    hot_on_device = placement.hot_experts if fast_device.type == "cuda" else 0
    hot_plan = (
        plan_frequency(stats, per_layer=hot_on_device) if placement.hot_strategy != "uniform" and stats
        else plan_uniform(len(moe_layers), n, hot_on_device)
    )
    n_mixed = round(placement.mixed_hot_fraction * n)
    mixed_plan = (plan_frequency(stats, per_layer=n_mixed) if stats else plan_uniform(len(moe_layers), n, n_mixed)
                  ) if n_mixed else None
    dynamic = placement.dynamic_hot
    fast_dev = str(fast_device)
    plans = {}
    for j, i in enumerate(moe_layers):
        hot = tuple(hot_plan.hot[j])

        def shards(fmt: str, high: tuple[int, ...], high_fmt: str, hot=hot) -> tuple[ShardSpec, ...]:
            cold = [e for e in range(n) if e not in hot]
            out = [ShardSpec("bf16", hot, fast_dev)] if hot else []
            for fmt_, ids in ((high_fmt, [e for e in cold if e in high]), (fmt, [e for e in cold if e not in high])):
                if ids:
                    out.append(ShardSpec(fmt_, tuple(ids), "cpu"))
            return tuple(out)

        fast = shards(placement.fast_format, tuple(mixed_plan.hot[j]) if mixed_plan else (),
                      placement.mixed_format or placement.exact_format)
        base = placement.execution_format or placement.fast_format
        if i in formatting:
            exact = shards(placement.exact_format, (), placement.exact_format, hot=() if dynamic else hot)
        elif base != placement.fast_format or dynamic:  # a dynamic hot set must not move execution's numerics
            exact = shards(base, (), base, hot=() if dynamic else hot)
        else:
            exact = fast
        plans[i] = LayerPlan(fast, exact)
    return plans


@dataclass
class ExpertShard:
    packed: PackedExperts
    device: torch.device

    @property
    def label(self) -> str:
        return f"{self.packed.fmt}@{self.device.type}x{self.packed.num_experts}"


@dataclass
class LayerExperts:
    """The expert shards of one MoE layer under both profiles."""

    fast: list[ExpertShard]
    exact: list[ExpertShard]
    num_threads: int | None = None  # kernel threads; None: torch's setting
    counts: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))

    def host_experts(self, exact: bool) -> torch.Tensor:
        """[E] bool: which experts of the profile are computed from host memory (the CPU kernel)."""
        key = "_host_exact" if exact else "_host_fast"
        if key not in self.__dict__:
            mask = torch.zeros(self.counts.numel(), dtype=torch.bool)
            for shard in self.exact if exact else self.fast:
                if shard.device.type == "cpu":
                    mask[list(shard.packed.expert_ids)] = True
            self.__dict__[key] = mask
        return self.__dict__[key]

    def all_on_host(self, exact: bool) -> bool:
        """Whether every shard of the profile is in host memory (no hot experts on the fast device)."""
        return all(s.device.type == "cpu" for s in (self.exact if exact else self.fast))

    def compute_host(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, exact: bool = False,
                     num_threads: int | None = None) -> torch.Tensor | None:
        """The host shards' CPU kernels, summed in profile order: x [R, H] on the host -> [R, H] fp32 (None: no host shard)."""
        return self._sum(x, ids, weights, exact, num_threads, host=True)

    def compute_device(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                       exact: bool = False) -> torch.Tensor | None:
        """The shards on the fast device (hot experts): x [T, H] there -> [T, H] fp32 (None: no such shard)."""
        return self._sum(x, ids, weights, exact, None, host=False)

    def _sum(self, x, ids, weights, exact, num_threads, host: bool) -> torch.Tensor | None:
        out = None
        for shard in self.exact if exact else self.fast:
            if (shard.device.type == "cpu") != host:
                continue
            y = fused_moe(x, ids, weights, shard.packed, skip_missing=True,
                          num_threads=num_threads or self.num_threads)  # [R, H] fp32
            out = y if out is None else out + y
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of every distinct shard (a profile shared by both modes counts once)."""
        seen = {id(s.packed): s.packed.nbytes for s in self.fast + self.exact}
        return sum(seen.values())

    def record(self, ids: torch.Tensor) -> None:
        """Accumulates routing counts (for frequency placement and mixed precision). ids [T, K], -1 for none.
        On the CPU through numpy views (once per layer and step: torch's per-op cost was ~3x numpy's here)."""
        if ids.device.type != "cpu" or self.counts.device.type != "cpu":
            self.counts += torch.bincount(ids[ids >= 0].cpu(), minlength=self.counts.numel()).to(self.counts.device)
            return
        flat = ids.numpy().reshape(-1)
        if flat.size and flat.min() < 0:
            flat = flat[flat >= 0]
        counts = self.counts.numpy()
        counts += np.bincount(flat, minlength=counts.size).astype(counts.dtype, copy=False)


def save_routing_stats(path: str | Path, layers: dict[int, LayerExperts]) -> None:
    """Writes the observed routing counts (one row per MoE layer) in the kernels' stats format."""
    save_stats(path, [layers[i].counts.tolist() for i in sorted(layers)])
