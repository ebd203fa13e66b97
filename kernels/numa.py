"""NUMA topology (from /sys/devices/system/node) and assignment of experts and threads to nodes.

With one node everything maps to node 0. With more, each layer's experts are spread over nodes so
that expected work (bytes streamed x activation frequency) per CPU is balanced inside every layer
(layers run one after another, so per-layer balance is what keeps all nodes busy), and each node
gets threads on its own CPUs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kernels.placement import PlacementError

SYS_NODE_DIR = Path("/sys/devices/system/node")


@dataclass(frozen=True)
class NumaNode:
    node_id: int
    cpus: tuple[int, ...]
    mem_bytes: int


@dataclass(frozen=True)
class NumaTopology:
    nodes: tuple[NumaNode, ...]

    @property
    def num_cpus(self) -> int:
        return sum(len(n.cpus) for n in self.nodes)

    def summary(self) -> str:
        parts = [f"node{n.node_id}: {len(n.cpus)} cpus, {n.mem_bytes / 2**30:.1f} GiB" for n in self.nodes]
        return f"NUMA {len(self.nodes)} node(s) [{'; '.join(parts)}]"


def parse_cpulist(text: str) -> tuple[int, ...]:
    """'0-3,8,10-11' -> (0, 1, 2, 3, 8, 10, 11)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(cpus)


def detect_topology(root: Path = SYS_NODE_DIR) -> NumaTopology:
    """Nodes under ``root``; a single node holding all CPUs if the directory is missing."""
    nodes = []
    if root.is_dir():
        for d in sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
            cpus = parse_cpulist((d / "cpulist").read_text()) if (d / "cpulist").exists() else ()
            mem = 0
            meminfo = d / "meminfo"
            if meminfo.exists():
                for line in meminfo.read_text().splitlines():
                    if "MemTotal:" in line:
                        mem = int(line.split()[-2]) * 1024
            nodes.append(NumaNode(int(d.name[4:]), cpus, mem))
    if not nodes:
        nodes = [NumaNode(0, tuple(range(os.cpu_count() or 1)), 0)]
    return NumaTopology(tuple(nodes))


@dataclass(frozen=True)
class NumaPlan:
    """expert_node[layer][expert] = node id; threads[node id] = CPUs its worker threads run on."""

    expert_node: tuple[tuple[int, ...], ...]
    threads: dict[int, tuple[int, ...]]
    load: tuple[tuple[float, ...], ...]  # per layer, per node (in topology order): work per CPU

    def experts_on(self, layer: int, node: int) -> tuple[int, ...]:
        return tuple(e for e, n in enumerate(self.expert_node[layer]) if n == node)

    def imbalance(self) -> float:
        """Worst over layers of max/mean node load per CPU (1.0 = perfectly balanced)."""
        worst = 1.0
        for loads in self.load:
            mean = sum(loads) / len(loads)
            if mean > 0:
                worst = max(worst, max(loads) / mean)
        return worst

    def summary(self) -> str:
        counts = {n: sum(row.count(n) for row in self.expert_node) for n in self.threads}
        nodes = ", ".join(f"node{n}: {counts[n]} experts, {len(c)} threads" for n, c in self.threads.items())
        return f"NUMA placement [{nodes}], imbalance {self.imbalance():.2f}"


def assign_to_nodes(topology: NumaTopology, expert_bytes: list[list[int]],
                    counts: list[list[float]] | None = None) -> NumaPlan:
    """Greedy longest-processing-time per layer: heaviest expert to the node with the least work per CPU.

    expert_bytes[layer][expert] = bytes streamed per activation; counts = activation frequencies
    (uniform if None). Ties resolve to the lower node id and lower expert id, so the plan is stable.
    """
    nodes = [n for n in topology.nodes if n.cpus]
    if not nodes:
        raise PlacementError("the topology has no node with CPUs")
    if counts is not None and [len(r) for r in counts] != [len(r) for r in expert_bytes]:
        raise PlacementError("counts and expert_bytes must have the same [layer][expert] shape")
    expert_node, loads = [], []
    for layer, row in enumerate(expert_bytes):
        freq = counts[layer] if counts is not None else [1.0] * len(row)
        total_freq = sum(freq) or 1.0
        work = [b * (f / total_freq + 1e-9) for b, f in zip(row, freq, strict=True)]
        raw = [0.0] * len(nodes)
        owner = [0] * len(row)
        for e in sorted(range(len(row)), key=lambda e: (-work[e], e)):
            best = min(range(len(nodes)), key=lambda i: ((raw[i] + work[e]) / len(nodes[i].cpus), i))
            raw[best] += work[e]
            owner[e] = nodes[best].node_id
        expert_node.append(tuple(owner))
        loads.append(tuple(r / len(n.cpus) for r, n in zip(raw, nodes, strict=True)))
    threads = {n.node_id: n.cpus for n in nodes}
    return NumaPlan(tuple(expert_node), threads, tuple(loads))


# -- applying a plan: mbind(2) on the packed weights -----------------------------------------------
MPOL_BIND = 2
MPOL_F_ADDR = 2  # get_mempolicy: the policy of the page at addr
MPOL_MF_MOVE = 2  # migrate pages already touched (by the loading threads) to the bound node
_SYSCALLS = {"x86_64": (237, 239), "aarch64": (235, 236)}  # (mbind, get_mempolicy)
PAGE = 4096


def _syscalls():
    import ctypes
    import platform

    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None or not Path("/proc/self/numa_maps").exists():
        return None
    return ctypes.CDLL(None, use_errno=True), numbers


def bind_range(addr: int, nbytes: int, node: int) -> bool:
    """Binds the whole pages inside [addr, addr + nbytes) to `node` (migrating them): True on success.
    Pages shared with a neighbouring range keep their node (a slot's edges), and nothing happens where
    the kernel has no mbind (not Linux, or built without NUMA)."""
    import ctypes

    sc = _syscalls()
    start, end = -(-addr // PAGE) * PAGE, (addr + nbytes) // PAGE * PAGE
    if sc is None or end <= start:
        return False
    libc, (mbind, _) = sc
    mask = ctypes.c_ulong(1 << node)
    rc = libc.syscall(mbind, ctypes.c_void_p(start), ctypes.c_ulong(end - start), MPOL_BIND,
                      ctypes.byref(mask), ctypes.c_ulong(64), MPOL_MF_MOVE)
    return rc == 0


def policy_node(addr: int) -> tuple[int, int] | None:
    """(policy mode, node mask) of the page at `addr` (get_mempolicy with MPOL_F_ADDR); None if unavailable."""
    import ctypes

    sc = _syscalls()
    if sc is None:
        return None
    libc, (_, get_mempolicy) = sc
    mode, mask = ctypes.c_int(0), ctypes.c_ulong(0)
    rc = libc.syscall(get_mempolicy, ctypes.byref(mode), ctypes.byref(mask), ctypes.c_ulong(64),
                      ctypes.c_void_p(addr // PAGE * PAGE), MPOL_F_ADDR)
    return (mode.value, mask.value) if rc == 0 else None


def bind_expert_slots(tensors: dict, expert_ids: tuple[int, ...], node_of: dict[int, int]) -> int:
    """Binds each expert's slot (dim 0 of every packed tensor) to its node. Returns the bytes bound."""
    bound = 0
    for t in tensors.values():
        if not t.numel() or t.device.type != "cpu" or not t.is_contiguous():
            continue
        slot = t.numel() // t.shape[0] * t.element_size()
        for k, e in enumerate(expert_ids):
            if bind_range(t.data_ptr() + k * slot, slot, node_of.get(e, 0)):
                bound += slot
    return bound
