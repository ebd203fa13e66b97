"""ModelConfig: the Hugging Face config.json of a MoE checkpoint, normalised once."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import CheckpointError, UnsupportedArchitectureError

SUPPORTED_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    hidden_act: str
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections
    qk_norm: str  # "none" | "per_head" (Qwen3: RMSNorm over head_dim) | "full" (OLMoE: over all heads)
    clip_qkv: float | None
    sliding_window: int | None
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int  # 0: no shared expert
    dense_intermediate_size: int  # MLP width of non-MoE layers
    moe_layers: tuple[bool, ...]
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise UnsupportedArchitectureError(self.arch, SUPPORTED_ARCHS)
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if not 0 < self.top_k <= self.num_experts:
            raise CheckpointError(f"num_experts_per_tok={self.top_k} must be in 1..{self.num_experts}")
        if len(self.moe_layers) != self.num_layers:
            raise CheckpointError("moe_layers must have one entry per layer")
        if self.hidden_act != "silu":
            raise CheckpointError(f"hidden_act {self.hidden_act!r} is not supported (only 'silu')")

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @property
    def last_moe_layer(self) -> int:
        return max(i for i, m in enumerate(self.moe_layers) if m)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{path} not found: a checkpoint directory needs a config.json")
        try:
            hf = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
        eos = _eos_ids(hf, Path(model_dir) / "generation_config.json")
        return cls.from_hf(hf, eos_token_ids=eos)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], eos_token_ids: tuple[int, ...] = ()) -> ModelConfig:
        arch = hf.get("model_type", "")
        if arch not in SUPPORTED_ARCHS:
            raise UnsupportedArchitectureError(arch or "<missing model_type>", SUPPORTED_ARCHS)

        def need(*names: str) -> Any:
            for name in names:
                if hf.get(name) is not None:
                    return hf[name]
            raise CheckpointError(f"config.json of a {arch} model lacks {' / '.join(names)}")

        hidden = need("hidden_size")
        heads = need("num_attention_heads")
        layers = need("num_hidden_layers")
        num_experts = need("num_experts", "num_local_experts")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise CheckpointError(f"rope type {rope_type!r} is not supported (only 'default')")
        rope_theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))

        if arch == "mixtral":
            moe_inter = need("intermediate_size")
            dense_inter = moe_inter
        else:
            moe_inter = need("moe_intermediate_size") if arch != "olmoe" else need("intermediate_size")
            dense_inter = hf.get("intermediate_size", moe_inter)
        mlp_only = set(hf.get("mlp_only_layers") or [])
        step = hf.get("decoder_sparse_step", 1) or 1
        moe_layers = tuple(
            i not in mlp_only and num_experts > 0 and (i + 1) % step == 0 for i in range(layers)
        )
        sliding = None
        if arch == "mixtral":
            sliding = hf.get("sliding_window")
        elif hf.get("use_sliding_window"):
            raise CheckpointError("use_sliding_window=true is not supported for qwen models")

        return cls(
            arch=arch,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hidden // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            hidden_act=hf.get("hidden_act", "silu"),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("qkv_bias", True)) if arch == "qwen2_moe"
            else bool(hf.get("attention_bias", False)),
            qk_norm={"qwen3_moe": "per_head", "olmoe": "full"}.get(arch, "none"),
            clip_qkv=hf.get("clip_qkv"),
            sliding_window=sliding,
            num_experts=num_experts,
            top_k=need("num_experts_per_tok"),
            moe_intermediate_size=moe_inter,
            norm_topk_prob=True if arch == "mixtral" else bool(hf.get("norm_topk_prob", False)),
            shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size") or 0
            if arch == "qwen2_moe" else 0,
            dense_intermediate_size=dense_inter,
            moe_layers=moe_layers,
            eos_token_ids=eos_token_ids or _as_ids(hf.get("eos_token_id")),
        )


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _eos_ids(hf: dict[str, Any], generation_config: Path) -> tuple[int, ...]:
    ids = list(_as_ids(hf.get("eos_token_id")))
    if generation_config.is_file():
        try:
            gen = json.loads(generation_config.read_text())
        except json.JSONDecodeError:
            gen = {}
        ids += [i for i in _as_ids(gen.get("eos_token_id")) if i not in ids]
    return tuple(ids)
