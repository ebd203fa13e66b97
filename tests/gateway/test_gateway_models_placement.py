"""/v1/models carries the engine's placement plan (real server, official openai client)."""

from __future__ import annotations


def test_models_report_the_placement_plan(gateway_server):
    client = gateway_server.client()
    card = client.models.retrieve("moegate-demo")
    listed = client.models.list().data[0]
    plan = card.model_extra["moegate"]["placement"]
    assert listed.model_extra["moegate"]["placement"] == plan
    assert plan["fast_device"] == "cpu" and "NUMA" in plan["numa"]
    engine = gateway_server.state.llm.engine
    assert plan["moe_layers"] == engine.model_config.num_moe_layers
    experts = [r for r in plan["parts"] if r["part"] == "routed_experts"]
    assert experts and all(r["where"] == "cpu (host)" and r["unit"] == "experts" for r in experts)
    # every MoE layer's experts appear once per profile; the shard bytes are the engine's own
    n = engine.model_config.num_experts * engine.model_config.num_moe_layers
    for role in ("exploration", "execution"):
        assert sum(r["count"] for r in experts if r["format"].endswith((f"({role})", "(both modes)"))) == n
    assert sum(r["bytes"] for r in experts) == sum(le.nbytes for le in engine.layer_experts.values())
    assert any(r["part"] == "attention" and r["where"] == "cpu" for r in plan["parts"])
