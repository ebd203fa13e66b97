"""A policy's precision profiles become the engine's two resident expert profiles."""

from __future__ import annotations

from pathlib import Path

from gateway.app import numerics_from_policy
from policies.loader import load_policy

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
