"""A policy's precision profiles become the engine's two resident expert profiles."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.app import numerics_from_policy
from policies.loader import load_policy
from policies.model import HotExperts, Policy

EXAMPLES = Path(__file__).resolve().parents[2] / "policies" / "examples"


def test_finance_profiles_map_to_placement():
    n = numerics_from_policy(load_policy(EXAMPLES / "finance.yaml"))
    placement, exact_lm_head, fast_lm_head, fast_dense = n.experts, n.exact_lm_head, n.fast_lm_head, n.fast_dense
    assert placement.fast_format == "int4"  # exploration: fast profile
    assert placement.execution_format == "int8"  # execution: routed experts
    assert (placement.formatting_layers, placement.exact_format) == (4, "bf16")  # formatting layers
    assert exact_lm_head and fast_lm_head == "bf16"  # lm_head: fp32 in execution, bf16 in exploration
    assert fast_dense == "int8"  # exploration attention projections through the int8 CPU kernel


def test_dev_profile_explores_in_int4_and_executes_at_the_checkpoints_precision():
    n = numerics_from_policy(load_policy(EXAMPLES / "dev.yaml"), defer=1)
    placement, exact_lm_head, fast_lm_head, fast_dense = n.experts, n.exact_lm_head, n.fast_lm_head, n.fast_dense
    assert n.defer == 1 and n.parts("execution", "float32")["defer"] == 0  # execution never defers
    assert placement.fast_format == "int4" and placement.execution_format == "bf16"
    assert placement.formatting_layers == 0 and not exact_lm_head and fast_lm_head == "int8"  # the model's lm_head
    assert fast_dense == "int8"


def _with_hot(policy, profile: str, **hot):
    profiles = dict(policy.precision_profiles)
    profiles[profile] = profiles[profile].model_copy(update={"hot_experts": HotExperts(**hot)})
    return Policy.model_validate({**policy.model_dump(), "precision_profiles": {
        k: v.model_dump() for k, v in profiles.items()}})


def test_exploration_hot_experts_become_a_dynamic_hot_set():
    policy = _with_hot(load_policy(EXAMPLES / "dev.yaml"), "fast", exact_share=0.25, interval_steps=16, max_swaps=3)
    placement = numerics_from_policy(policy).experts
    assert placement.dynamic_hot and placement.mixed_hot_fraction == 0.25 and placement.mixed_format == "bf16"
    assert (placement.dynamic.interval_steps, placement.dynamic.max_swaps) == (16, 3)
    assert placement.hot_experts == 0


def test_hot_experts_are_refused_where_they_cannot_apply():
    dev = load_policy(EXAMPLES / "dev.yaml")
    with pytest.raises(ValidationError, match="exploration only"):
        _with_hot(dev, "exact", exact_share=0.25)
    with pytest.raises(ValidationError, match="gpu_per_layer > 0 or exact_share > 0"):
        HotExperts()
    with pytest.raises(ValidationError, match="not both"):
        HotExperts(gpu_per_layer=2, exact_share=0.25)
    with pytest.raises(ValidationError, match="needs stats_file"):
        HotExperts(exact_share=0.25, strategy="frequency")
