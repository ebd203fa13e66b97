"""CPU routed-expert kernels, quantized expert weight formats, pack cache and expert placement."""

from kernels.formats import (
    DEFAULT_GROUP_SIZE,
    FORMATS,
    LAYOUT_VERSION,
    FormatError,
    PackedExperts,
    pack_experts,
)
from kernels.fused_moe import (
    ExpertIdError,
    backend_summary,
    fused_moe,
    fused_moe_reference,
    kernel_available,
    kernel_variant,
)

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "FORMATS",
    "LAYOUT_VERSION",
    "ExpertIdError",
    "FormatError",
    "PackedExperts",
    "backend_summary",
    "fused_moe",
    "fused_moe_reference",
    "kernel_available",
    "kernel_variant",
    "pack_experts",
]
