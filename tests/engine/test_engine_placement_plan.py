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


def test_numa_is_a_stated_no_op_on_one_node_and_not_claimed_on_several():
    one = NumaTopology((NumaNode(0, (0, 1), 24 << 30),))
    two = NumaTopology((NumaNode(0, (0, 1), 12 << 30), NumaNode(1, (2, 3), 12 << 30)))
    assert "no-op" in numa_statement(one)
    assert "NOT bound" in numa_statement(two) and "2 node(s)" in numa_statement(two)
