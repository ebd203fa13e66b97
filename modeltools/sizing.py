"""Exact parameter counts of a MoE checkpoint per placement part, from config.json and safetensors headers."""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.archs import SUPPORTED_ARCHS, LinearAttentionDims
from engine.config import ModelConfig, read_hf_config
from engine.errors import CheckpointError, UnsupportedArchitectureError
from engine.gguf import find_gguf
from engine.gguf_config import text_layers
from engine.gguf_file import open_gguf
from engine.parts import (
    ATTENTION,
    DENSE_MLP,
    EMBED,
    LM_HEAD,
    NORMS,
    OTHER,
    PARTS,
    ROUTED,
    ROUTER,
    SHARED,
    classify,
)

# safetensors dtype tag -> bytes per element
_ST_DTYPE_BYTES = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
    "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1,
}


class SizingError(ValueError):
    """A model directory cannot be sized: missing or inconsistent config.json / safetensors."""


@dataclass(frozen=True)
class ModelShape:
    """The numbers of config.json that decide memory, normalised across the supported architectures."""

    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    dense_intermediate_size: int  # MLP width of layers without experts
    shared_expert_intermediate_size: int  # 0: no shared expert
    attention_bias: bool  # bias on q/k/v (and o for OLMoE/Qwen3 attention_bias)
    tie_word_embeddings: bool
    moe_layers: tuple[bool, ...]
    checkpoint_dtype: str  # "bfloat16", "float32", ... as written in config.json
    kv_cache_layout: tuple[int, int, int]  # ModelConfig.kv_cache_layout: (tensors, heads, width)
    mla: tuple[int | None, int, int, int, int] | None = None  # q_lora_rank, kv_lora_rank, nope, rope, v head dims
    router_bias: bool = False  # DeepSeek-V3's e_score_correction_bias, GPT-OSS's router bias
    shared_expert_gate: bool = False  # Qwen2-MoE's shared_expert_gate
    o_proj_bias: bool = False  # GPT-OSS: attention_bias puts a bias on o_proj too
    attention_sinks: bool = False  # GPT-OSS: one sink logit per head and layer
    expert_bias: bool = False  # GPT-OSS: biases on every expert's gate_up and down
    qk_norm: str = "none"  # ModelConfig.qk_norm
    # Qwen3-Next: gated DeltaNet layers (no KV; a recurrent state per sequence) and q_proj's output gate
    linear_attention: LinearAttentionDims | None = None
    num_linear_layers: int = 0
    attention_output_gate: bool = False

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise SizingError(f"num_attention_heads {self.num_heads} is not a multiple of "
                              f"num_key_value_heads {self.num_kv_heads}")
        if not 0 < self.top_k <= self.num_experts:
            raise SizingError(f"num_experts_per_tok={self.top_k} must be in 1..{self.num_experts}")
        if len(self.moe_layers) != self.num_layers:
            raise SizingError("moe_layers needs one entry per layer")
        if not any(self.moe_layers):
            raise SizingError("no layer has routed experts (mlp_only_layers / decoder_sparse_step): "
                              "this is a dense model, not a MoE")

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelShape:
        """From config.json or a GGUF file's metadata, read as the engine reads them (engine.config)."""
        try:
            return cls.from_hf(read_hf_config(model_dir))
        except CheckpointError as exc:
            raise SizingError(str(exc)) from exc

    def kv_bytes_per_token(self, bits: int) -> int:
        """KV cache bytes of one token over every layer: K and V per KV head, or MLA's latent."""
        tensors, heads, width = self.kv_cache_layout
        return tensors * (self.num_layers - self.num_linear_layers) * heads * width * bits // 8

    @property
    def state_bytes_per_sequence(self) -> int:
        """fp32 recurrent state of one sequence over the linear-attention layers (0 without them)."""
        la = self.linear_attention
        if la is None:
            return 0
        return 4 * la.state_elements * self.num_linear_layers

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelShape:
        """The registry's reading of config.json (engine.archs), kept to what decides memory."""
        try:
            cfg = ModelConfig.from_hf(hf)
        except UnsupportedArchitectureError:
            raise SizingError(f"unsupported model_type {hf.get('model_type', '')!r}: moegate sizes "
                              f"{', '.join(SUPPORTED_ARCHS)}") from None
        except CheckpointError as exc:
            raise SizingError(str(exc)) from exc
        mla = ((cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim)
               if cfg.attention == "mla" else None)
        return cls(
            arch=cfg.arch, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
            num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
            num_experts=cfg.num_experts, top_k=cfg.top_k, moe_intermediate_size=cfg.moe_intermediate_size,
            dense_intermediate_size=cfg.dense_intermediate_size,
            shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
            attention_bias=cfg.attention_bias, tie_word_embeddings=cfg.tie_word_embeddings,
            moe_layers=cfg.moe_layers,
            checkpoint_dtype=str(hf.get("dtype") or hf.get("torch_dtype") or "bfloat16"),
            kv_cache_layout=cfg.kv_cache_layout, mla=mla,
            router_bias=cfg.router in ("sigmoid_grouped", "topk_softmax"), shared_expert_gate=cfg.shared_expert_gate,
            o_proj_bias=cfg.o_proj_bias, attention_sinks=cfg.attention_sinks, expert_bias=cfg.expert_bias,
            qk_norm=cfg.qk_norm, linear_attention=cfg.linear_attention, num_linear_layers=len(cfg.linear_layers),
            attention_output_gate=cfg.attention_output_gate,
        )


@dataclass(frozen=True)
class Weight:
    """`count` tensors of one `shape` belonging to one placement part."""

    part: str
    shape: tuple[int, ...]
    count: int

    @property
    def params(self) -> int:
        return math.prod(self.shape) * self.count


def weights(shape: ModelShape) -> list[Weight]:
    """Every tensor the checkpoint holds, grouped by shape, per part (matches Hugging Face modules)."""
    h, hd, heads, kv = shape.hidden_size, shape.head_dim, shape.num_heads, shape.num_kv_heads
    n_moe = shape.num_moe_layers
    n_dense = shape.num_layers - n_moe
    out = [Weight(EMBED, (shape.vocab_size, h), 1), Weight(NORMS, (h,), 2 * shape.num_layers + 1)]
    layers = shape.num_layers - shape.num_linear_layers  # attention layers
    out += _linear_attention_weights(shape)
    if not shape.tie_word_embeddings:
        out.append(Weight(LM_HEAD, (shape.vocab_size, h), 1))
    if shape.mla is not None:
        out += _latent_attention_weights(shape)
    else:
        out += [
            Weight(ATTENTION, ((2 if shape.attention_output_gate else 1) * heads * hd, h), layers),  # q_proj
            Weight(ATTENTION, (kv * hd, h), 2 * layers),  # k_proj, v_proj
            Weight(ATTENTION, (h, heads * hd), layers),  # o_proj
        ]
    if shape.attention_bias and shape.mla is None:
        out += [Weight(ATTENTION, (heads * hd,), layers), Weight(ATTENTION, (kv * hd,), 2 * layers)]
        if shape.arch in ("qwen3_moe", "olmoe") or shape.o_proj_bias:  # attention_bias also biases o_proj there
            out.append(Weight(ATTENTION, (h,), layers))
    if shape.attention_sinks:
        out.append(Weight(ATTENTION, (heads,), layers))
    if shape.qk_norm == "per_head":  # RMSNorm over head_dim (Qwen3, GLM-4.5 use_qk_norm)
        out.append(Weight(NORMS, (hd,), 2 * layers))
    elif shape.qk_norm == "full":  # RMSNorm over all heads (OLMoE)
        out += [Weight(NORMS, (h,), layers), Weight(NORMS, ((h // heads) * kv,), layers)]
    e, mi = shape.num_experts, shape.moe_intermediate_size
    if n_moe:
        out += [
            Weight(ROUTER, (e, h), n_moe),
            Weight(ROUTED, (mi, h), 2 * e * n_moe),  # gate_proj, up_proj of every expert
            Weight(ROUTED, (h, mi), e * n_moe),  # down_proj
        ]
        if shape.router_bias:
            out.append(Weight(ROUTER, (e,), n_moe))  # e_score_correction_bias / router.bias
        if shape.expert_bias:
            out += [Weight(ROUTED, (2 * mi,), e * n_moe), Weight(ROUTED, (h,), e * n_moe)]
    si = shape.shared_expert_intermediate_size
    if si and n_moe:
        out += [Weight(SHARED, (si, h), 2 * n_moe), Weight(SHARED, (h, si), n_moe)]
        if shape.shared_expert_gate:
            out.append(Weight(SHARED, (1, h), n_moe))
    if n_dense:
        di = shape.dense_intermediate_size
        out += [Weight(DENSE_MLP, (di, h), 2 * n_dense), Weight(DENSE_MLP, (h, di), n_dense)]
    return out


def _linear_attention_weights(shape: ModelShape) -> list[Weight]:
    """Qwen3-Next's gated DeltaNet layers: in_proj_qkvz, in_proj_ba, conv1d, dt_bias and A_log, norm, out_proj."""
    la, n, h = shape.linear_attention, shape.num_linear_layers, shape.hidden_size
    if la is None or not n:
        return []
    value = la.num_value_heads * la.value_head_dim
    return [Weight(ATTENTION, (2 * la.num_key_heads * la.key_head_dim + 2 * value, h), n),
            Weight(ATTENTION, (2 * la.num_value_heads, h), n), Weight(ATTENTION, (la.conv_dim, 1, la.conv_kernel), n),
            Weight(ATTENTION, (la.num_value_heads,), 2 * n), Weight(NORMS, (la.value_head_dim,), n),
            Weight(ATTENTION, (h, value), n)]


def _latent_attention_weights(shape: ModelShape) -> list[Weight]:
    """Multi-head latent attention (DeepSeek-V2/V3): q through a LoRA or direct, the shared KV latent."""
    q_rank, kv_rank, nope, rope, v = shape.mla
    h, heads, n = shape.hidden_size, shape.num_heads, shape.num_layers
    if q_rank is None:
        out = [Weight(ATTENTION, (heads * (nope + rope), h), n)]  # q_proj
    else:
        out = [Weight(ATTENTION, (q_rank, h), n), Weight(NORMS, (q_rank,), n),  # q_a_proj, q_a_layernorm
               Weight(ATTENTION, (heads * (nope + rope), q_rank), n)]  # q_b_proj
    out += [Weight(ATTENTION, (kv_rank + rope, h), n), Weight(NORMS, (kv_rank,), n),  # kv_a_proj_with_mqa, norm
            Weight(ATTENTION, (heads * (nope + v), kv_rank), n), Weight(ATTENTION, (h, heads * v), n)]  # kv_b, o
    if shape.attention_bias:  # q_a_proj, kv_a_proj_with_mqa and o_proj
        out += [Weight(ATTENTION, (kv_rank + rope,), n), Weight(ATTENTION, (h,), n)]
        if q_rank is not None:
            out.append(Weight(ATTENTION, (q_rank,), n))
    return out


def params_by_part(shape: ModelShape) -> dict[str, int]:
    counts = dict.fromkeys(PARTS, 0)
    for w in weights(shape):
        counts[w.part] += w.params
    return counts


def expert_params(shape: ModelShape) -> int:
    """Parameters of one routed expert (gate, up, down and their biases if any)."""
    biases = 2 * shape.moe_intermediate_size + shape.hidden_size if shape.expert_bias else 0
    return 3 * shape.hidden_size * shape.moe_intermediate_size + biases


@dataclass(frozen=True)
class CheckpointCensus:
    """What the safetensors headers of a directory declare, without loading a tensor."""

    params: dict[str, int]  # part -> elements
    bytes: dict[str, int]  # part -> bytes as stored
    file_bytes: int  # size of the .safetensors files on disk
    num_tensors: int


def read_header(path: Path) -> dict[str, Any]:
    """The JSON header of one .safetensors file (8-byte little-endian length, then JSON)."""
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise SizingError(f"{path} is too short to be a safetensors file")
        (length,) = struct.unpack("<Q", raw)
        if length > 100_000_000:
            raise SizingError(f"{path}: safetensors header of {length} bytes is implausible (corrupt file?)")
        try:
            header = json.loads(f.read(length))
        except json.JSONDecodeError as exc:
            raise SizingError(f"{path}: unreadable safetensors header: {exc}") from exc
    header.pop("__metadata__", None)
    return header


def _weights_held(name: str, numel: int) -> int:
    """Parameters a tensor holds: MXFP4 `*_blocks` pack two weights per byte, their `*_scales` hold none."""
    if name.endswith("_blocks"):
        return 2 * numel
    return 0 if name.endswith("_scales") else numel


def census(model_dir: str | Path) -> CheckpointCensus | None:
    """Per-part element and byte counts from every *.safetensors header in `model_dir`, or from the tensor
    index of its GGUF file (all shards of a split one); None if neither."""
    if (gguf_file := find_gguf(model_dir)) is not None:
        return gguf_census(gguf_file)
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    params = dict.fromkeys((*PARTS, OTHER), 0)
    nbytes = dict.fromkeys((*PARTS, OTHER), 0)
    n = 0
    for path in files:
        for name, info in read_header(path).items():
            part = classify(name)
            numel = math.prod(info["shape"])
            dtype = info["dtype"]
            if dtype not in _ST_DTYPE_BYTES:
                raise SizingError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
            params[part] += _weights_held(name, numel)
            nbytes[part] += numel * _ST_DTYPE_BYTES[dtype]
            n += 1
    return CheckpointCensus(params=params, bytes=nbytes,
                            file_bytes=sum(p.stat().st_size for p in files), num_tensors=n)


# llama.cpp tensor kinds (`blk.N.KIND.weight`) -> placement part; norms, attention and dense MLP by prefix
_GGUF_PARTS = {"token_embd": EMBED, "output": LM_HEAD, "ffn_gate_inp": ROUTER, "exp_probs_b": ROUTER}
_GGUF_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+?)(?:\.(weight|bias))?$")


def gguf_part(name: str) -> str:
    """Placement part of a GGUF tensor name (llama.cpp's naming)."""
    kind = m.group(2) if (m := _GGUF_BLOCK.match(name)) else name.rpartition(".")[0]
    if kind in _GGUF_PARTS:
        return _GGUF_PARTS[kind]
    if kind.endswith("_exps"):
        return ROUTED
    if kind.endswith("_shexp"):
        return SHARED
    if "norm" in kind:
        return NORMS
    if kind.startswith(("attn_", "ssm_")):  # ssm_*: Qwen3-Next's DeltaNet (linear_attn)
        return ATTENTION
    return DENSE_MLP if kind in ("ffn_gate", "ffn_up", "ffn_down") else OTHER


def gguf_census(path: Path) -> CheckpointCensus:
    """`census` of a GGUF model: weights per part from the tensor index (quantized tensors count their logical
    weights, and their bytes as stored); DeepSeek's attn_k_b / attn_v_b halves count once beside attn_kv_b, and
    multi-token-prediction blocks past the decoder layers (which the engine never runs) not at all."""
    model = open_gguf(path)
    garch = model.meta.get("general.architecture", "")
    layers = text_layers(model.meta, garch)
    params = dict.fromkeys((*PARTS, OTHER), 0)
    nbytes = dict.fromkeys((*PARTS, OTHER), 0)
    n = 0
    for name, info in model.tensors.items():
        m = _GGUF_BLOCK.match(name)
        if m and (int(m.group(1)) >= layers or (m.group(2) in ("attn_k_b", "attn_v_b")
                                                 and f"blk.{m.group(1)}.attn_kv_b.weight" in model.tensors)):
            continue
        part = gguf_part(name)
        params[part] += math.prod(info.shape)
        nbytes[part] += info.nbytes
        n += 1
    return CheckpointCensus(params=params, bytes=nbytes, file_bytes=sum(p.stat().st_size for p in model.paths),
                            num_tensors=n)
