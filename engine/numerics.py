"""The numerics profile: what computes a token in each mode, in one frozen object.

Precision per part (routed experts with their formatting layers, mixed precision and hot set; lm_head;
attention projections), exploration's expert deferral and whether small exploration batches run the fused
per-layer kernel. Built once (the gateway from its policy, `EngineConfig` from its fields otherwise),
resolved by the engine against what the device can run, then read for the numerics fingerprint (which
roots every prefix-cache chain and is the responses' `system_fingerprint`) and for `/v1/models`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from engine.mode import Mode

if TYPE_CHECKING:
    from engine.experts import PlacementConfig


@dataclass(frozen=True)
class NumericsProfile:
    experts: PlacementConfig | None = None  # None: routed experts unpacked, torch reference compute
    exact_lm_head: bool = False  # execution computes logits with an fp32 copy of lm_head
    fast_lm_head: str | None = None  # exploration lm_head: None (model dtype), bf16, int8, int4 (CPU)
    fast_dense: str | None = None  # exploration attention projections on CPU: None (model dtype), bf16, int8, int4
    defer: int = 0  # exploration: experts per token deferred to the next MoE layer (execution never defers)
    fused: bool = True  # small exploration batches run each layer in one kernel call (CPU, fp32, fast_dense)

    def __post_init__(self) -> None:
        if self.defer < 0:
            raise ValueError(f"defer must be >= 0, got {self.defer}")

    def resolved(self, device_type: str, fused_built: bool) -> NumericsProfile:
        """What actually runs: packed attention projections only on a CPU, fused layers only where built."""
        return replace(self, fast_dense=self.fast_dense if device_type == "cpu" else None, fused=fused_built)

    def with_defer(self, defer: int) -> NumericsProfile:
        return replace(self, defer=defer)

    def parts(self, mode: Mode, dtype: str) -> dict:
        """Precision per part in `mode` (`dtype`: the model's), deferral and fused or not."""
        p, execution = self.experts, Mode.parse(mode) == Mode.EXECUTION
        return {
            "experts": None if p is None else (
                [p.execution_format or p.fast_format, p.exact_format, p.formatting_layers] if execution
                else [p.fast_format, p.mixed_hot_fraction]
            ),
            "hot": None if p is None else [p.fast_format, p.hot_experts, p.hot_strategy],
            "lm_head": ("fp32" if self.exact_lm_head else dtype) if execution else (self.fast_lm_head or dtype),
            "dense": dtype if execution else (self.fast_dense or dtype),
            "fused": not execution and self.fused,
            "defer": 0 if execution else self.defer,
        }

    def fingerprint(self, mode: Mode, model_identity: str, dtype: str, exact_chunk: int) -> str:
        """`fp_<mode>_<hash>`: names what computes a token in `mode`. Execution also hashes its prefill chunk
        size (the chunking is part of its batch-invariant numerics)."""
        mode = Mode.parse(mode)
        key = {"model": model_identity, "dtype": dtype, **self.parts(mode, dtype),
               "chunk": exact_chunk if mode == Mode.EXECUTION else None}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
        return f"fp_{mode.value[:4]}_{digest[:16]}"
