"""The placement plan: where every tensor of the model lives, decided once before loading.

Dense parts (embeddings, attention, norms, router, shared experts, dense MLPs, lm_head) go to the fast
device (CUDA when present, else the CPU); routed experts go to packed shards in host memory, except a
hot set per layer on the fast device (CUDA only). The loader asks the plan where each tensor goes; the
engine prints `summary()` at startup and `/v1/models` returns `describe()`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.config import ModelConfig
from engine.experts import LayerPlan, PlacementConfig, plan_layers
from engine.parts import PARTS, ROUTED, classify
from kernels import load_stats
from kernels.numa import NumaPlan, NumaTopology, assign_to_nodes, bind_expert_slots, detect_topology

log = logging.getLogger(__name__)
GIB = 2**30


def numa_statement(topo: NumaTopology) -> str:
    """What the engine does about NUMA on this machine, in one line for the startup table."""
    if len(topo.nodes) == 1:
        return "1 NUMA node: NUMA placement is a no-op (all host memory and kernel threads on node 0)"
    return (f"{topo.summary()}: each expert's packed weights are bound to the node kernels.numa.assign_to_nodes "
            "gives it (mbind, balancing bytes x routing frequency per CPU); kernel threads are not pinned to nodes")


def apply_numa(layers: dict, topo: NumaTopology | None = None, counts: list[list[float]] | None = None,
               force: bool = False) -> NumaPlan | None:
    """Binds every host shard's expert slots to the node the NUMA plan gives them (more than one node, or
    `force`); None where there is nothing to do. `layers`: MoE layer -> LayerExperts."""
    topo = topo or detect_topology()
    if len(topo.nodes) < 2 and not force or not layers:
        return None
    order = sorted(layers)
    n = layers[order[0]].counts.numel()
    expert_bytes = []
    for i in order:
        row = [0] * n
        for shard in {id(s): s for s in layers[i].fast + layers[i].exact}.values():
            if shard.device.type == "cpu":
                for e in shard.packed.expert_ids:
                    row[e] += shard.packed.expert_nbytes()
        expert_bytes.append(row)
    plan = assign_to_nodes(topo, expert_bytes, counts)
    bound = 0
    for j, i in enumerate(order):
        node_of = dict(enumerate(plan.expert_node[j]))
        for shard in {id(s): s for s in layers[i].fast + layers[i].exact}.values():
            if shard.device.type == "cpu":
                bound += bind_expert_slots(shard.packed.tensors, shard.packed.expert_ids, node_of)
    log.info("%s; %.2f GiB of expert weights bound", plan.summary(), bound / GIB)
    return plan


@dataclass(frozen=True)
class PlacementPlan:
    fast_device: torch.device
    layers: dict[int, LayerPlan]  # MoE layer -> its expert shards (empty: experts unpacked on the fast device)
    numa: str  # what the NUMA planner did on this machine

    @classmethod
    def build(cls, cfg: ModelConfig, placement: PlacementConfig | None, fast_device: torch.device | str,
              ) -> PlacementPlan:
        """`placement` None: routed experts stay unpacked, at full precision on the fast device."""
        fast_device = torch.device(fast_device)
        stats = load_stats(placement.stats_file) if placement is not None and placement.stats_file else None
        layers = plan_layers(cfg, placement, fast_device, stats) if placement is not None else {}
        if placement is not None and placement.hot_experts and fast_device.type != "cuda":
            log.info("hot experts requested but the fast device is the CPU: all experts stay in host memory")
        return cls(fast_device, layers, numa_statement(detect_topology()))

    def device_for(self, name: str) -> torch.device:
        """Where a dense tensor (by parameter or checkpoint name) lives: the fast device."""
        if classify(name) == ROUTED and self.layers:
            raise ValueError(f"{name} is a routed expert: it lives in the shards of plan.layers")
        return self.fast_device

    def rows(self, model: torch.nn.Module) -> list[dict]:
        """One row per (part, device, format) with its tensor count and bytes, from the loaded model."""
        rows: dict[tuple[str, str, str], dict] = {}

        def add(part: str, where: str, fmt: str, count: int, nbytes: int, what: str = "tensors") -> None:
            row = rows.setdefault((part, where, fmt), {"part": part, "where": where, "format": fmt, "count": 0,
                                                       "unit": what, "bytes": 0})
            row["count"] += count
            row["bytes"] += nbytes

        seen = set()
        for name, p in model.named_parameters():
            if p.numel() == 0 or id(p) in seen:  # emptied expert parameters, tied weights
                continue
            seen.add(id(p))
            add(classify(name), str(p.device), str(p.dtype).removeprefix("torch."), 1, p.numel() * p.element_size())
        # per-mode copies beside the model's own weights: exploration's quantized attention and lm_head,
        # execution's fp32 lm_head and the fused execution path's packed attention and lm_head
        for layer in model.model.layers:
            attn = layer.mixer
            for packed, role in ((getattr(attn, "fast_qkv", None), "exploration"), (getattr(attn, "fast_o", None),
                                 "exploration"), (getattr(attn, "exact_qkv", None), "execution"),
                                 (getattr(attn, "exact_o", None), "execution")):
                if packed is not None:
                    add("attention", "cpu", f"{packed.fmt} ({role})", 1, packed.nbytes)
        if getattr(model, "exact_head", None) is not None:
            add("lm_head", "cpu", f"{model.exact_head.fmt} (execution)", 1, model.exact_head.nbytes)
        if getattr(model, "fast_lm_head", None) is not None:
            head = model.fast_lm_head
            add("lm_head", str(self.fast_device), f"{head.fmt} (exploration)", 1, head.nbytes)
        if getattr(model, "exact_lm_head", None) is not None:
            head = model.exact_lm_head
            add("lm_head", str(head.device), "float32 (execution)", 1, head.numel() * head.element_size())
        for i in self.layers:
            le = model.model.layers[i].mlp.experts.packed
            fast, exact = {id(s.packed) for s in le.fast}, {id(s.packed) for s in le.exact}
            for shard in {id(s.packed): s for s in le.fast + le.exact}.values():
                key = id(shard.packed)
                role = "both modes" if key in fast and key in exact else "exploration" if key in fast else "execution"
                hot = shard.device.type != "cpu"
                add("hot experts" if hot else ROUTED, f"{shard.device} ({'fast device' if hot else 'host'})",
                    f"{shard.packed.fmt} ({role})", shard.packed.num_experts, shard.packed.nbytes, "experts")
        order = {p: k for k, p in enumerate((*PARTS, "hot experts"))}
        return sorted(rows.values(), key=lambda r: (order.get(r["part"], len(order)), r["where"], r["format"]))

    def summary(self, model: torch.nn.Module) -> str:
        rows = self.rows(model)
        lines = [f"placement plan: fast device {self.fast_device}, routed experts in host memory; {self.numa}",
                 f"  {'part':<16}{'where':<22}{'format':<24}{'count':>14}{'GiB':>9}"]
        for r in rows:
            count = f"{r['count']} {r['unit']}"
            lines.append(f"  {r['part']:<16}{r['where']:<22}{r['format']:<24}{count:>14}{r['bytes'] / GIB:>9.3f}")
        by_device: dict[str, int] = {}
        for r in rows:
            dev = r["where"].split(" ")[0]
            by_device[dev] = by_device.get(dev, 0) + r["bytes"]
        lines.append("  total: " + ", ".join(f"{d} {b / GIB:.3f} GiB" for d, b in sorted(by_device.items())))
        return "\n".join(lines)

    def describe(self, model: torch.nn.Module) -> dict:
        """The plan as JSON-able data (for /v1/models)."""
        return {"fast_device": str(self.fast_device), "numa": self.numa, "parts": self.rows(model),
                "moe_layers": len(self.layers),
                "hot_experts_per_layer": max((sum(len(s.expert_ids) for s in p.fast if s.hot)
                                              for p in self.layers.values()), default=0)}
