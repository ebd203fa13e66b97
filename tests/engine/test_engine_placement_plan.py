"""The placement plan: where each tensor lives, one concise table, the NUMA statement."""

from __future__ import annotations

import pytest
import torch

from engine.config import ModelConfig
from engine.experts import PlacementConfig, ShardSpec, plan_layers
from engine.loader import load_model
from engine.placement_plan import PlacementPlan, numa_statement
from kernels.numa import NumaNode, NumaTopology


def test_hot_experts_go_to_cuda_and_stay_shared_between_profiles(hf_checkpoint):
    cfg = ModelConfig.from_dir(hf_checkpoint("qwen3_moe"))
    placement = PlacementConfig(fast_format="int4", exact_format="bf16", formatting_layers=1, hot_experts=2)
    plans = plan_layers(cfg, placement, torch.device("cuda"))
    first, last = plans[0], plans[1]
    hot = ShardSpec("bf16", (0, 1), "cuda")
    assert first.fast == first.exact == (hot, ShardSpec("int4", tuple(range(2, 8)), "cpu"))
    assert last.exact == (hot, ShardSpec("bf16", tuple(range(2, 8)), "cpu"))
    assert last.shards == (hot, ShardSpec("int4", tuple(range(2, 8)), "cpu"), last.exact[1])
    on_cpu = plan_layers(cfg, placement, torch.device("cpu"))  # no hot set without a GPU
    assert all(not s.hot for p in on_cpu.values() for s in p.shards)


def test_plan_places_every_tensor_and_prints_one_short_table(hf_checkpoint):
    path = hf_checkpoint("qwen3_moe")
    cfg = ModelConfig.from_dir(path)
    placement = PlacementConfig(fast_format="int4", execution_format="int8", exact_format="bf16", formatting_layers=1)
    plan = PlacementPlan.build(cfg, placement, "cpu")
    assert plan.device_for("model.layers.0.self_attn.q_proj.weight") == torch.device("cpu")
    with pytest.raises(ValueError, match="routed expert"):
        plan.device_for("model.layers.0.mlp.experts.3.up_proj.weight")
    model = load_model(path, progress=False, placement=placement, plan=plan)
    rows = plan.rows(model)
    table = plan.summary(model).splitlines()
    assert len(table) == len(rows) + 3  # title, header, rows, total: not one line per tensor
    experts = {r["format"]: r for r in rows if r["part"] == "routed_experts"}
    assert set(experts) == {"int4 (exploration)", "int8 (execution)", "bf16 (execution)"}
    assert experts["int4 (exploration)"]["count"] == 16  # 2 MoE layers x 8 experts
    assert experts["int8 (execution)"]["count"] == 8 and experts["bf16 (execution)"]["count"] == 8
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    shards = sum(layer.mlp.experts.packed.nbytes for layer in model.model.layers)
    assert sum(r["bytes"] for r in rows) == params + shards
    assert plan.describe(model)["parts"] == rows


def test_numa_is_a_stated_no_op_on_one_node_and_says_what_it_binds_on_several():
    one = NumaTopology((NumaNode(0, (0, 1), 24 << 30),))
    two = NumaTopology((NumaNode(0, (0, 1), 12 << 30), NumaNode(1, (2, 3), 12 << 30)))
    assert "no-op" in numa_statement(one)
    assert "bound to the node" in numa_statement(two) and "2 node(s)" in numa_statement(two)
    assert "threads are not pinned" in numa_statement(two)


def test_numa_plan_binds_every_expert_slot_to_its_node(hf_checkpoint):
    from engine.llm_engine import LLM
    from engine.placement_plan import apply_numa
    from kernels.numa import MPOL_BIND, detect_topology, policy_node

    path = hf_checkpoint("qwen3_moe", hidden_size=256, moe_intermediate_size=256)  # slots of whole pages
    llm = LLM(path, placement=PlacementConfig(fast_format="int4", exact_format="bf16", formatting_layers=1),
              num_kv_blocks=16, block_size=8, progress=False)
    layers = llm.engine.layer_experts
    assert llm.engine.numa_plan is None or len(detect_topology().nodes) > 1  # one node: nothing bound
    one_node = NumaTopology((NumaNode(0, (0, 1), 0),))
    plan = apply_numa(layers, one_node, force=True)  # the same code a multi-node machine runs, on node 0
    assert plan is not None and all(set(row) == {0} for row in plan.expert_node)
    if policy_node(next(iter(layers.values())).fast[0].packed.tensors["gate_up"].data_ptr()) is None:
        pytest.skip("no mbind on this kernel")
    checked = 0
    for le in layers.values():
        for shard in le.fast + le.exact:
            t = shard.packed.tensors["gate_up"]
            slot = t.numel() // t.shape[0] * t.element_size()
            assert slot >= 2 * 4096  # every slot holds whole pages
            for k in range(t.shape[0]):
                assert policy_node(t.data_ptr() + k * slot + slot // 2) == (MPOL_BIND, 1)  # node 0's bit
                checked += 1
    assert checked >= 8
