"""Hot-expert placement strategies and NUMA assignment (synthetic multi-node topologies)."""

from __future__ import annotations

import pytest

from kernels.numa import NumaNode, NumaTopology, assign_to_nodes, detect_topology, parse_cpulist
from kernels.placement import (
    DynamicPlacement,
    HotExpertPlan,
    PlacementError,
    load_stats,
    plan_frequency,
    plan_uniform,
    save_stats,
)

COUNTS = [[5, 0, 9, 1, 7, 2], [0, 3, 3, 8, 1, 10]]


def test_uniform_and_frequency() -> None:
    assert plan_uniform(3, 8, 2).hot == ((0, 1),) * 3
    plan = plan_frequency(COUNTS, per_layer=2)
    assert plan.hot == ((2, 4), (3, 5))
    assert plan.cold(0) == (0, 1, 3, 5)
    assert plan.coverage(COUNTS) == pytest.approx((16 + 18) / (24 + 25))
    ties = plan_frequency([[1, 1, 1, 1]], per_layer=2)
    assert ties.hot == ((0, 1),)
    # total budget: globally hottest by per-layer share (9/24=.375, 10/25=.4, 8/25=.32, 7/24=.29)
    assert plan_frequency(COUNTS, total=3).hot == ((2,), (3, 5))
    assert "covering" in plan.summary(COUNTS) and "4 of 12" in plan.summary()


def test_stats_file_round_trip(tmp_path) -> None:
    path = tmp_path / "stats.json"
    save_stats(path, COUNTS)
    assert load_stats(path) == [[float(c) for c in row] for row in COUNTS]
    path.write_text('{"counts": [[1, 2], [3]]}')
    with pytest.raises(PlacementError):
        load_stats(path)


def test_bad_inputs() -> None:
    with pytest.raises(PlacementError):
        plan_uniform(2, 4, 5)
    with pytest.raises(PlacementError):
        plan_frequency(COUNTS)
    with pytest.raises(PlacementError):
        plan_frequency([[1, 2], [3]], per_layer=1)
    with pytest.raises(PlacementError):
        HotExpertPlan("x", 4, ((1, 1),))


def test_dynamic_swaps_follow_shifted_routing() -> None:
    dyn = DynamicPlacement(plan_uniform(2, 6, 2), decay=0.5, threshold=0.05, max_swaps=1)
    for _ in range(6):
        dyn.observe(0, [4, 5, 4, 5, 0, -1])
        dyn.observe(1, [0, 1, 0, 1])
    assert dyn.propose() != []
    first = dyn.propose()
    assert len(first) == 1 and first[0].layer == 0 and first[0].admit in (4, 5) and first[0].evict == 1
    dyn.apply(first)
    with pytest.raises(PlacementError, match="stale"):
        dyn.apply(first)
    assert dyn.plan().hot == ((0, 4), (0, 1))
    second = dyn.propose()
    assert [(s.layer, s.evict, s.admit) for s in second] == [(0, 0, 5)]
    dyn.apply(second)
    assert dyn.plan().hot == ((4, 5), (0, 1)) and dyn.plan().strategy == "dynamic"
    assert dyn.propose() == []  # hot sets now match routing in both layers


def test_dynamic_threshold_blocks_small_gains() -> None:
    dyn = DynamicPlacement(plan_uniform(1, 4, 1), decay=1.0, threshold=0.3, max_swaps=4)
    dyn.observe(0, [0, 0, 0, 1, 1, 1, 1])  # expert 1 is only 1/7 ahead of expert 0
    assert dyn.propose() == []


def test_numa_detect_and_single_node() -> None:
    assert parse_cpulist("0-3,8,10-11") == (0, 1, 2, 3, 8, 10, 11)
    topo = detect_topology()
    assert topo.nodes and topo.num_cpus >= 1
    plan = assign_to_nodes(topo, [[100] * 8] * 2)
    first = topo.nodes[0].node_id
    if len(topo.nodes) == 1:
        assert set(plan.expert_node[0]) == {first} and plan.imbalance() == 1.0
    assert "NUMA" in topo.summary() and "imbalance" in plan.summary()


def test_numa_synthetic_topology(tmp_path) -> None:
    for node, cpus in ((0, "0-3"), (1, "4-7")):
        d = tmp_path / f"node{node}"
        d.mkdir()
        (d / "cpulist").write_text(cpus + "\n")
        (d / "meminfo").write_text(f"Node {node} MemTotal:       16384 kB\n")
    topo = detect_topology(tmp_path)
    assert [n.cpus for n in topo.nodes] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert topo.nodes[1].mem_bytes == 16384 * 1024
    counts = [[10, 10, 1, 1, 1, 1, 4, 4], [1] * 8]
    plan = assign_to_nodes(topo, [[100] * 8, [100] * 8], counts)
    assert plan.threads == {0: (0, 1, 2, 3), 1: (4, 5, 6, 7)}
    assert set(plan.experts_on(0, 0)).isdisjoint(plan.experts_on(0, 1))
    assert {plan.expert_node[0][0], plan.expert_node[0][1]} == {0, 1}  # the two hot experts split
    assert plan.imbalance() <= 1.05
    assert len(plan.experts_on(1, 0)) == len(plan.experts_on(1, 1)) == 4


def test_numa_uneven_nodes_balance_per_cpu() -> None:
    topo = NumaTopology((NumaNode(0, (0, 1, 2), 0), NumaNode(1, (3,), 0), NumaNode(2, (), 0)))
    plan = assign_to_nodes(topo, [[1] * 8])
    assert len(plan.experts_on(0, 0)) == 6 and len(plan.experts_on(0, 1)) == 2
    assert 2 not in plan.threads
