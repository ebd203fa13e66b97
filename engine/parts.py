"""Placement parts: which part of the model a checkpoint tensor belongs to, by its Hugging Face name."""

from __future__ import annotations

# Placement parts. Everything but ROUTED lives on the fast device (GPU when present).
EMBED, LM_HEAD, ATTENTION, NORMS, ROUTER, SHARED, DENSE_MLP, ROUTED, OTHER = (
    "embed", "lm_head", "attention", "norms", "router", "shared_experts", "dense_mlp", "routed_experts",
    "other",
)
PARTS = (EMBED, LM_HEAD, ATTENTION, NORMS, ROUTER, SHARED, DENSE_MLP, ROUTED)


def classify(name: str) -> str:
    """Placement part of a checkpoint tensor name (Hugging Face hub naming of the four archs)."""
    if "embed_tokens" in name:
        return EMBED
    if name.startswith("lm_head"):
        return LM_HEAD
    if "shared_expert" in name:
        return SHARED
    if ".experts." in name or name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
        return ROUTED
    if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight", "mlp.gate.e_score_correction_bias",
                      "mlp.router.weight", "mlp.router.bias")):
        return ROUTER
    if "norm" in name:
        return NORMS
    if ".self_attn." in name or ".linear_attn." in name:
        return ATTENTION
    if ".mlp." in name:
        return DENSE_MLP
    return OTHER
