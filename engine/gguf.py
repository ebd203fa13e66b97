"""GGUF files (llama.cpp): the model config from their metadata, tensors by Hugging Face name, dequantized on read.

A GGUF model is a directory holding one `*.gguf` file (no config.json) or the file itself; its
tokenizer is the `tokenizer.json` beside it (the GGUF's own vocabulary is not converted). Supported
GGUF architectures: qwen3moe, qwen2moe and llama with experts (Mixtral). Tensors map from llama.cpp
names (`blk.N.attn_q.weight`, `blk.N.ffn_gate_exps.weight` [E, I, H], ...) to the engine's; the expert
tensors read one expert at a time, and every supported type (F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q6_K, ...)
is dequantized with the `gguf` package as the tensor is read, so routed experts go through the expert
stream into the project's packed formats like any checkpoint. llama.cpp stores q/k of llama-arch
models permuted for its interleaved RoPE; they are permuted back here. qwen2moe/qwen3moe use NEOX RoPE
and are stored unpermuted.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.errors import CheckpointError, UnsupportedCheckpointError
from engine.gguf_file import TensorInfo, open_gguf

ARCHS = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe", "llama": "mixtral"}
DEQUANTIZABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file `path` names (the file, or a directory with one *.gguf and no config.json), else None."""
    path = Path(path)
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    if (path / "config.json").is_file():
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        raise UnsupportedCheckpointError(
            f"{path} holds {len(files)} .gguf files ({', '.join(f.name for f in files[:3])}...): "
            "give the one to serve (--model FILE.gguf); split GGUF files (-00001-of-N) are not supported")
    return files[0] if files else None


def model_dir_of(path: str | Path) -> Path:
    """The directory of a model given as a directory or as a .gguf file (tokenizer files live there)."""
    path = Path(path)
    return path.parent if find_gguf(path) == path else path


def hf_config(path: Path) -> dict[str, Any]:
    """A Hugging Face style config dict from the GGUF metadata and tensor list (for ModelConfig.from_hf)."""
    file = open_gguf(path)
    meta, tensors = file.meta, file.tensors
    arch = meta.get("general.architecture")
    if arch not in ARCHS or (arch == "llama" and not meta.get("llama.expert_count")):
        kind = f"{arch!r} without experts" if arch == "llama" else repr(arch)
        raise UnsupportedCheckpointError(f"GGUF architecture {kind} is not supported (moegate reads {', '.join(ARCHS)} "
                                         "with experts)")

    def need(key: str) -> Any:
        if f"{arch}.{key}" not in meta:
            raise CheckpointError(f"{path.name} lacks GGUF metadata {arch}.{key}")
        return meta[f"{arch}.{key}"]

    layers, hidden, heads = need("block_count"), need("embedding_length"), need("attention.head_count")
    moe = [f"blk.{i}.ffn_gate_inp.weight" in tensors for i in range(layers)]
    hf: dict[str, Any] = {
        "model_type": ARCHS[arch], "hidden_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv", heads),
        "head_dim": meta.get(f"{arch}.attention.key_length", hidden // heads),
        "rms_norm_eps": need("attention.layer_norm_rms_epsilon"),
        "rope_theta": meta.get(f"{arch}.rope.freq_base", 10000.0),
        "max_position_embeddings": need("context_length"),
        "vocab_size": tensors["token_embd.weight"].shape[0] if "token_embd.weight" in tensors else need("vocab_size"),
        "tie_word_embeddings": "output.weight" not in tensors,
        "num_experts_per_tok": need("expert_used_count"),
        "mlp_only_layers": [i for i, m in enumerate(moe) if not m],
        "attention_bias": "blk.0.attn_q.bias" in tensors, "qkv_bias": "blk.0.attn_q.bias" in tensors,
        "norm_topk_prob": bool(meta.get(f"{arch}.expert_weights_norm", arch != "qwen2moe")),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    experts, expert_ffn = need("expert_count"), meta.get(f"{arch}.expert_feed_forward_length")
    if arch == "llama":
        hf.update(num_local_experts=experts, intermediate_size=need("feed_forward_length"))
    else:
        hf.update(num_experts=experts, moe_intermediate_size=expert_ffn or need("feed_forward_length"),
                  intermediate_size=meta.get(f"{arch}.feed_forward_length", expert_ffn),
                  shared_expert_intermediate_size=meta.get(f"{arch}.expert_shared_feed_forward_length", 0))
    rope_type = meta.get(f"{arch}.rope.scaling.type", "none")
    if rope_type not in ("none", "linear", "yarn"):
        raise UnsupportedCheckpointError(f"GGUF rope scaling {rope_type!r} is not supported")
    if rope_type != "none":
        hf["rope_scaling"] = {"rope_type": rope_type, "factor": need("rope.scaling.factor"),
                              "original_max_position_embeddings": meta.get(f"{arch}.rope.scaling.original_context_length")}
    return hf


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's q/k permutation for interleaved RoPE (convert_hf_to_gguf's LlamaModel.permute)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GgufCheckpoint:
    """A GGUF file seen as a checkpoint by Hugging Face name (the loader's `_Checkpoint` interface)."""

    def __init__(self, path: Path, arch: str, num_heads: int, num_kv_heads: int) -> None:
        import gguf

        self.files, self.handles = [path], []
        self._file = open_gguf(path)
        self._permute = {"attn_q": num_heads, "attn_k": num_kv_heads} if arch == "mixtral" else {}
        self.where: dict[str, tuple[Any, Path]] = {}
        self._source: dict[str, tuple[TensorInfo, int | None, str]] = {}  # HF name -> (tensor, expert, gguf kind)
        for t in self._file.tensors.values():
            qtype = gguf.GGMLQuantizationType(t.qtype).name
            if qtype not in DEQUANTIZABLE:
                raise UnsupportedCheckpointError(f"GGUF tensor {t.name} is {qtype}: moegate dequantizes {', '.join(DEQUANTIZABLE)}")
            for name, expert, kind in self._names(t.name, t.shape[0] if t.name.endswith("_exps.weight") else 0):
                self.where[name] = (self, path)
                self._source[name] = (t, expert, kind)

    @staticmethod
    def _names(name: str, experts: int) -> list[tuple[str, int | None, str]]:
        stem, _, suffix = name.rpartition(".")
        if stem in _GLOBAL:
            return [(f"{_GLOBAL[stem]}.{suffix}", None, stem)]
        m = _BLOCK.match(name)
        if not m:
            return [(name, None, "")]  # unknown: the loader reports it as unexpected
        layer, kind = m.group(1), m.group(2)
        if kind in _EXPERTS:
            return [(f"model.layers.{layer}.mlp.experts.{e}.{_EXPERTS[kind]}.weight", e, kind) for e in range(experts)]
        if kind in _LAYER:
            return [(f"model.layers.{layer}.{_LAYER[kind]}.{suffix}", None, kind)]
        return [(name, None, kind)]

    def shape(self, name: str) -> tuple[int, ...]:
        t, expert, _ = self._source[name]
        shape = t.shape[1:] if expert is not None else t.shape
        return (shape[0], 1) if name.endswith("shared_expert_gate.weight") and len(shape) == 1 else shape

    def get(self, name: str, expert: int | None = None) -> torch.Tensor:
        """The tensor dequantized to fp32 (`expert` is unused: GGUF experts are listed one name per expert)."""
        import gguf

        t, e, kind = self._source[name]
        data = self._file.raw(t.name) if e is None else self._file.raw(t.name)[e]
        try:
            values = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(t.qtype))
        except (NotImplementedError, ValueError) as exc:
            raise CheckpointError(f"cannot dequantize GGUF tensor {t.name}: {exc}") from exc
        out = torch.from_numpy(np.array(values, dtype=np.float32)).reshape(self.shape(name))  # a copy, not the mmap
        if kind in self._permute:
            out = _unpermute(out, self._permute[kind])
        return out
