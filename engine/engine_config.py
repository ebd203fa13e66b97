"""EngineConfig: how one engine runs a checkpoint (dtype, device, KV cache, batching, numerics, prefix cache)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.experts import PlacementConfig
from engine.multi_token import MultiTokenConfig
from engine.numerics import NumericsProfile

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "float32"
    device: str = "auto"  # auto | cpu | cuda
    block_size: int = 16
    num_kv_blocks: int | None = None  # default: from kv_cache_gib
    kv_cache_gib: float = 1.0
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    mask_unused_vocab: bool = True  # never sample embedding rows the tokenizer has no token for
    placement: PlacementConfig | None = None  # None: routed experts unpacked, torch reference compute
    defer: int = 0  # exploration: experts per token deferred to the next MoE layer (0 = strict)
    exact_lm_head: bool = False  # execution mode computes logits with an fp32 copy of lm_head
    fast_lm_head: str | None = None  # exploration lm_head: None (model dtype), "bf16", "int8" or "int4" (CPU)
    fast_dense: str | None = None  # exploration attention projections on CPU: None (model dtype), int8, int4, bf16
    fused_decode: bool = True  # with fast_dense on CPU: small exploration batches run each layer in one kernel call
    # exploration forwards of at least this many tokens run their routed experts on the fast device, layer by
    # layer (engine/layerwise_prefill.py); "auto": on CUDA at 512 tokens, off on the CPU; None: off
    layerwise_prefill_tokens: int | str | None = "auto"
    batch_invariant_execution: bool = True  # CPU fp32: execution chunks share one forward on batch-invariant kernels
    # The eight fields above in one object (engine/numerics.py): pass either `numerics` or those fields.
    numerics: NumericsProfile | None = None
    progress: bool = True
    # Multi-token decoding (engine/multi_token.py). jump_forward_tokens: forced tokens of a constrained
    # execution sequence appended per step without a forward each (0: off; bytes unchanged).
    # speculative_tokens: prompt-lookup drafts verified per step for unconstrained sequences (0: off),
    # matched on the last speculative_ngram (down to 1) tokens, or drafted by the checkpoint's multi-token-
    # prediction layer (speculative_source "mtp": engine/mtp.py; a checkpoint without one fails to load).
    jump_forward_tokens: int = 32
    speculative_tokens: int = 0
    speculative_ngram: int = 3
    speculative_source: str = "ngram"
    # Prefix cache. The device tier (the KV pool) is on unless prefix_cache=False; RAM, disk and redis
    # hold demoted blocks. The library writes no disk cache unless told where (`moegate serve` passes
    # engine.prefix_cache.default_disk_cache_dir()).
    prefix_cache: bool = True
    ram_cache_gib: float = 1.0
    disk_cache_dir: str | None = None
    disk_cache_gib: float = 8.0
    redis_url: str | None = None
    redis_cache_ttl_s: int = 24 * 3600
    # linear-attention models (Qwen3-Next): recurrent-state snapshots kept for prefix-cache hits (engine/
    # recurrent_state.py); None: max_num_seqs with the prefix cache on; 0: such models get no prefix hits
    state_snapshots: int | None = None

    def __post_init__(self) -> None:
        if self.defer < 0:
            raise ValueError(f"defer must be >= 0, got {self.defer}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        self.multi_token  # noqa: B018 - validates the multi-token fields
        if min(self.ram_cache_gib, self.disk_cache_gib, self.state_snapshots or 0) < 0:
            raise ValueError("ram_cache_gib and disk_cache_gib must be >= 0")
        legacy = {"placement": "experts", "exact_lm_head": "exact_lm_head", "fast_lm_head": "fast_lm_head",
                  "fast_dense": "fast_dense", "defer": "defer", "fused_decode": "fused",
                  "layerwise_prefill_tokens": "layerwise_tokens", "batch_invariant_execution": "exact_fused"}
        if self.numerics is None:
            object.__setattr__(self, "numerics", NumericsProfile(**{p: getattr(self, c) for c, p in legacy.items()}))
            return
        for ours, theirs in legacy.items():  # the separate fields follow the profile (they may repeat it)
            value, default = getattr(self.numerics, theirs), type(self).__dataclass_fields__[ours].default
            if getattr(self, ours) not in (default, value):
                raise ValueError(f"{ours}={getattr(self, ours)!r} contradicts numerics.{theirs}={value!r}; "
                                 "pass one of them")
            object.__setattr__(self, ours, value)

    @property
    def multi_token(self) -> MultiTokenConfig:
        return MultiTokenConfig(self.jump_forward_tokens, self.speculative_tokens, self.speculative_ngram,
                                draft_source=self.speculative_source)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def resolve_device(self) -> torch.device:
        return resolve_device(self.device)


def resolve_device(device: str) -> torch.device:
    """`auto` -> CUDA when present, else the CPU; `cpu` / `cuda` as given."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)
