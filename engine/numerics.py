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


LAYERWISE_PREFILL_TOKENS = 512  # a burst this long keeps a GPU busier than the copy of a layer's experts


@dataclass(frozen=True)
class NumericsProfile:
    experts: PlacementConfig | None = None  # None: routed experts unpacked, torch reference compute
    exact_lm_head: bool = False  # execution computes logits with an fp32 copy of lm_head
    fast_lm_head: str | None = None  # exploration lm_head: None (model dtype), bf16, int8, int4 (CPU)
    fast_dense: str | None = None  # exploration attention projections on CPU: None (model dtype), bf16, int8, int4
    defer: int = 0  # exploration: experts per token deferred to the next MoE layer (execution never defers)
    fused: bool = True  # small exploration batches run each layer in one kernel call (CPU, fp32, fast_dense)
    # exploration forwards of at least this many tokens run their routed experts on the fast device, layer by
    # layer (engine/layerwise_prefill.py); "auto": LAYERWISE_PREFILL_TOKENS on CUDA, off on the CPU; None: off
    layerwise_tokens: int | str | None = "auto"
    exact_fused: bool = True  # execution chunks share one forward on the batch-invariant fused path (CPU, fp32)

    def __post_init__(self) -> None:
        if self.defer < 0:
            raise ValueError(f"defer must be >= 0, got {self.defer}")
        lw = self.layerwise_tokens
        if not (lw is None or lw == "auto" or (isinstance(lw, int) and lw >= 1)):
            raise ValueError(f"layerwise_prefill_tokens must be 'auto', None or an int >= 1, got {lw!r}")

    def resolved(self, device_type: str, fused_built: bool, exact_built: bool = False) -> NumericsProfile:
        """What actually runs: packed attention projections only on a CPU, fused layers only where built,
        layer-wise prefill by default only where the fast device is a GPU."""
        lw = self.layerwise_tokens
        if lw == "auto":
            lw = LAYERWISE_PREFILL_TOKENS if device_type == "cuda" else None
        return replace(self, fast_dense=self.fast_dense if device_type == "cpu" else None, fused=fused_built,
                       layerwise_tokens=lw, exact_fused=exact_built)

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
            "fused": self.exact_fused if execution else self.fused,
            "defer": 0 if execution else self.defer,
            "layerwise": None if execution else self.layerwise_tokens,
        }

    def fingerprint(self, mode: Mode, model_identity: str, dtype: str, exact_chunk: int,
                    hot_set: str | None = None) -> str:
        """`fp_<mode>_<hash>`: names what computes a token in `mode`. Execution also hashes its prefill chunk
        size (the chunking is part of its batch-invariant numerics); exploration the current dynamic hot set."""
        mode = Mode.parse(mode)
        key = {"model": model_identity, "dtype": dtype, **self.parts(mode, dtype),
               "chunk": exact_chunk if mode == Mode.EXECUTION else None,
               "hot_set": hot_set if mode == Mode.EXPLORATION else None}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
        return f"fp_{mode.value[:4]}_{digest[:16]}"
