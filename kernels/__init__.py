"""CPU routed-expert kernels, quantized expert weight formats, pack cache and expert placement."""

from kernels.cpu_features import CpuFeatures, detect, select_variant
from kernels.formats import (
    DEFAULT_GROUP_SIZE,
    FORMATS,
    LAYOUT_VERSION,
    REGISTRY,
    FormatError,
    PackedExperts,
    WeightFormat,
    formats_for,
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
from kernels.numa import NumaPlan, NumaTopology, assign_to_nodes, detect_topology
from kernels.pack_cache import PackCache, file_identity, tensor_digest
from kernels.placement import (
    DynamicPlacement,
    HotExpertPlan,
    PlacementError,
    Swap,
    load_stats,
    plan_frequency,
    plan_uniform,
    save_stats,
)

__all__ = [
    "CpuFeatures",
    "DynamicPlacement",
    "HotExpertPlan",
    "NumaPlan",
    "NumaTopology",
    "PackCache",
    "PlacementError",
    "Swap",
    "assign_to_nodes",
    "detect",
    "detect_topology",
    "file_identity",
    "load_stats",
    "plan_frequency",
    "plan_uniform",
    "save_stats",
    "select_variant",
    "tensor_digest",
    "DEFAULT_GROUP_SIZE",
    "FORMATS",
    "LAYOUT_VERSION",
    "REGISTRY",
    "WeightFormat",
    "formats_for",
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
