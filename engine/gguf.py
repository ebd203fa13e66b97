"""GGUF files (llama.cpp): the model config from their metadata, tensors by Hugging Face name, dequantized on read.

A GGUF model is a directory holding one `*.gguf` file or one split model (llama.cpp's
`NAME-0000i-of-0000N.gguf` shards, engine/gguf_file.py), no config.json, or the file (any shard) itself;
its tokenizer is the `tokenizer.json` beside it, else the vocabulary the GGUF carries (engine/gguf_tokenizer.py).
The architectures read are the registry entries with a `gguf_arch` (qwen3moe, qwen2moe, llama with experts,
olmoe, glm4moe, deepseek2, gpt-oss, qwen3next: engine/gguf_config.py). Tensors map from llama.cpp names (`blk.N.attn_q.weight`,
`blk.N.ffn_gate_exps.weight` [E, I, H], ...) to the engine's; the expert tensors read one expert at a time,
and every supported type (F32, F16, BF16, Q8_0, Q4_0, Q4_K, Q6_K, MXFP4, ...) is dequantized with the `gguf`
package as the tensor is read, so routed experts go through the expert stream into the project's packed
formats like any checkpoint. llama.cpp stores q/k of llama-arch models permuted for its interleaved RoPE;
they are permuted back here (the other families are stored unpermuted). DeepSeek's `kv_b_proj` is read
whole (`attn_kv_b`) or rebuilt from the per-head halves newer files store (`attn_k_b` transposed,
`attn_v_b`); multi-token-prediction blocks past the decoder layers (`nextn_predict_layers`) are unused.
GPT-OSS's experts, which llama.cpp splits into gate / up / down with biases, are read back as its fused
layout (`gate_up_proj` [E, H, 2I] gate/up interleaved) one expert at a time. Qwen3-Next's DeltaNet tensors come
back from its converter's form (`ssm_a` = -exp(A_log), norms stored plus 1, in_proj_qkvz split into attn_qkv and
attn_gate: `_delta_net`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.archs import ARCHS as REGISTRY
from engine.errors import CheckpointError, UnsupportedCheckpointError
from engine.gguf_config import hf_config, text_layers
from engine.gguf_file import SHARD, TensorInfo, open_gguf, shard_name

__all__ = ["ARCHS", "GgufCheckpoint", "find_gguf", "hf_config", "model_dir_of"]

ARCHS = {spec.model_type: spec.gguf_arch for spec in REGISTRY.values() if spec.gguf_arch}  # model_type -> GGUF
DEQUANTIZABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                 "MXFP4")

_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",  # glm4moe's name for the same norm
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm", "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa", "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "ffn_gate_inp": "mlp.gate", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_SHARED_EXPERTS = ("deepseek_v3", "deepseek_v2", "glm4_moe")  # n_shared_experts as one ungated `shared_experts`
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+?)(?:\.(weight|bias))?$")  # Qwen3-Next's ssm_a has no suffix
# Qwen3-Next's DeltaNet (linear_attn) tensors; attn_qkv + attn_gate are read back as its in_proj_qkvz
_DELTA_NET = {"ssm_a": "A_log", "ssm_conv1d": "conv1d.weight", "ssm_dt": "dt_bias", "ssm_norm": "norm.weight",
              "ssm_ba": "in_proj_ba.weight", "ssm_out": "out_proj.weight", "attn_qkv": "in_proj_qkvz.weight"}
_ZERO_CENTRED = ("attn_norm", "post_attention_norm", "attn_q_norm", "attn_k_norm", "output_norm")  # stored + 1


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file `path` names, else None: the file itself (a shard of a split file: its first shard), or in
    a directory without config.json its one *.gguf file or the first shard of its one split model."""
    path = Path(path)
    if path.is_file():
        if path.suffix != ".gguf":
            return None
        m = SHARD.match(path.name)
        return path.with_name(shard_name(m["stem"], 1, int(m["count"]))) if m else path
    if (path / "config.json").is_file():
        return None
    files = sorted(path.glob("*.gguf"))
    splits = {(m["stem"], m["count"]) for f in files if (m := SHARD.match(f.name))}
    if len(splits) == 1 and all(SHARD.match(f.name) for f in files):
        stem, count = splits.pop()
        return path / shard_name(stem, 1, int(count))  # open_gguf names a missing shard
    if len(files) > 1:
        raise UnsupportedCheckpointError(
            f"{path} holds {len(files)} .gguf files ({', '.join(f.name for f in files[:3])}...): "
            "give the one to serve (--model FILE.gguf, or the first shard NAME-00001-of-N.gguf of a split model)")
    return files[0] if files else None


def model_dir_of(path: str | Path) -> Path:
    """The directory of a model given as a directory or as a .gguf file (tokenizer files live there)."""
    path = Path(path)
    return path.parent if find_gguf(path) == path else path


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's q/k permutation for interleaved RoPE (convert_hf_to_gguf's LlamaModel.permute)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GgufCheckpoint:
    """A GGUF model seen as a checkpoint by Hugging Face name (the loader's `_Checkpoint` interface)."""

    def __init__(self, path: Path, arch: str, num_heads: int, num_kv_heads: int) -> None:
        import gguf

        self._file = open_gguf(path)
        self.files, self.handles = self._file.paths, []
        self._arch = arch
        self._permute = {"attn_q": num_heads, "attn_k": num_kv_heads} if arch == "mixtral" else {}
        garch = self._file.meta.get("general.architecture", "")
        layers = text_layers(self._file.meta, garch) if f"{garch}.nextn_predict_layers" in self._file.meta else None
        self.where: dict[str, tuple[Any, Path]] = {}
        self._source: dict[str, tuple[TensorInfo, int | None, str]] = {}  # HF name -> (tensor, expert, gguf kind)
        tensors = self._file.tensors
        for t in tensors.values():
            qtype = gguf.GGMLQuantizationType(t.qtype).name
            if qtype not in DEQUANTIZABLE:
                raise UnsupportedCheckpointError(f"GGUF tensor {t.name} is {qtype}: moegate dequantizes {', '.join(DEQUANTIZABLE)}")
            if layers is not None and (b := re.match(r"blk\.(\d+)\.", t.name)) and int(b.group(1)) >= layers:
                continue  # a multi-token-prediction block: decoding never runs it
            m = _BLOCK.match(t.name)
            if m and m.group(2) in ("attn_k_b", "attn_v_b"):
                if f"blk.{m.group(1)}.attn_kv_b.weight" in tensors:
                    continue  # the halves llama.cpp also stores of a kv_b_proj read whole
                other = t.name.replace(*(("attn_k_b", "attn_v_b") if m.group(2) == "attn_k_b" else ("attn_v_b", "attn_k_b")))
                if other not in tensors:
                    raise CheckpointError(f"GGUF tensor {t.name} has no {other} (kv_b_proj needs both halves)")
            if m and arch == "gpt_oss" and m.group(2) in ("ffn_gate_exps", "ffn_up_exps"):
                other = t.name.replace(*(("gate", "up") if "gate" in m.group(2) else ("up", "gate")))
                if other not in tensors:
                    raise CheckpointError(f"GGUF tensor {t.name} has no {other} (gate_up_proj needs both)")
            if m and arch == "qwen3_next" and m.group(2) in ("attn_qkv", "attn_gate"):
                other = t.name.replace(*(("qkv", "gate") if m.group(2) == "attn_qkv" else ("gate", "qkv")))
                if other not in tensors:
                    raise CheckpointError(f"GGUF tensor {t.name} has no {other} (in_proj_qkvz needs both)")
            for name, expert, kind in self._names(t.name, t.shape[0] if t.name.endswith("_exps.weight") else 0):
                if kind == "attn_v_b" or (arch == "gpt_oss" and kind == "ffn_up_exps") or \
                        (arch == "qwen3_next" and kind == "attn_gate"):
                    continue  # read with attn_k_b as kv_b_proj, with ffn_gate_exps as GPT-OSS's gate_up_proj, with
                    # attn_qkv as Qwen3-Next's in_proj_qkvz
                self.where[name] = (self, path)
                self._source[name] = (t, expert, kind)

    def _names(self, name: str, experts: int) -> list[tuple[str, int | None, str]]:
        stem, _, suffix = name.rpartition(".")
        if stem in _GLOBAL:
            return [(f"{_GLOBAL[stem]}.{suffix}", None, stem)]
        m = _BLOCK.match(name)
        if not m:
            return [(name, None, "")]  # unknown: the loader reports it as unexpected
        layer, kind = m.group(1), m.group(2)
        prefix = f"model.layers.{layer}."
        if self._arch == "gpt_oss" and kind in _EXPERTS:  # its fused layout: the loader's `gpt_oss` experts
            fused = "gate_up_proj" if kind != "ffn_down_exps" else "down_proj"
            return [(f"{prefix}mlp.experts.{fused}{'_bias' if suffix == 'bias' else ''}", None, kind)]
        if kind == "attn_sinks" and self._arch == "gpt_oss":
            return [(f"{prefix}self_attn.sinks", None, kind)]
        if kind in _EXPERTS:
            return [(f"{prefix}mlp.experts.{e}.{_EXPERTS[kind]}.weight", e, kind) for e in range(experts)]
        if self._arch == "qwen3_next" and kind in _DELTA_NET:
            return [(f"{prefix}linear_attn.{_DELTA_NET[kind]}", None, kind)]
        if kind == "exp_probs_b":
            return [(f"{prefix}mlp.gate.e_score_correction_bias", None, kind)]
        if kind in ("attn_k_b", "attn_v_b"):
            return [(f"{prefix}self_attn.kv_b_proj.weight", None, kind)]
        if kind in _LAYER:
            hf = _LAYER[kind]
            if self._arch in _SHARED_EXPERTS:
                hf = hf.replace("shared_expert.", "shared_experts.")
            return [(f"{prefix}{hf}.{suffix}", None, kind)]
        return [(name, None, kind)]

    def shape(self, name: str) -> tuple[int, ...]:
        t, expert, kind = self._source[name]
        if kind == "attn_k_b":  # k_b [H, kv_lora, nope] and v_b [H, v, kv_lora] -> kv_b_proj [H * (nope + v), kv_lora]
            v_b = self._file.tensors[t.name.replace("attn_k_b", "attn_v_b")]
            return (t.shape[0] * (t.shape[2] + v_b.shape[1]), t.shape[1])
        if self._arch == "gpt_oss" and kind in _EXPERTS:  # stored as HF stores them: [E, H, 2I], [E, I, H], biases
            if t.name.endswith(".bias"):
                return (t.shape[0], 2 * t.shape[1]) if kind == "ffn_gate_exps" else t.shape
            return (t.shape[0], t.shape[2], 2 * t.shape[1] if kind == "ffn_gate_exps" else t.shape[1])
        if self._arch == "qwen3_next" and kind in ("attn_qkv", "ssm_conv1d"):
            gate = self._file.tensors[t.name.replace("attn_qkv", "attn_gate")] if kind == "attn_qkv" else None
            return (t.shape[0] + gate.shape[0], t.shape[1]) if gate else (t.shape[0], 1, t.shape[1])
        shape = t.shape[1:] if expert is not None else t.shape
        return (shape[0], 1) if name.endswith("shared_expert_gate.weight") and len(shape) == 1 else shape

    def _read(self, t: TensorInfo, expert: int | None = None) -> torch.Tensor:
        import gguf

        data = self._file.raw(t.name) if expert is None else self._file.raw(t.name)[expert]
        try:
            values = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(t.qtype))
        except (NotImplementedError, ValueError) as exc:
            raise CheckpointError(f"cannot dequantize GGUF tensor {t.name}: {exc}") from exc
        return torch.from_numpy(np.array(values, dtype=np.float32))  # a copy, not the mmap

    def _gpt_oss_expert(self, t: TensorInfo, kind: str, e: int) -> torch.Tensor:
        """Expert e of GPT-OSS's fused tensors from llama.cpp's split ones: gate/up interleaved in columns
        (gate_up [H, 2I], its bias [2I]), down transposed ([I, H]), the down bias as it is."""
        if kind == "ffn_down_exps":
            return self._read(t, e) if t.name.endswith(".bias") else self._read(t, e).reshape(t.shape[1:]).t()
        up = self._file.tensors[t.name.replace("ffn_gate_exps", "ffn_up_exps")]
        gate, up = self._read(t, e).reshape(t.shape[1:]), self._read(up, e).reshape(up.shape[1:])  # [I, H] or [I]
        return torch.stack([gate.t(), up.t()], dim=-1).reshape(*gate.shape[1:], -1)  # [H, 2I] or [2I]

    def get(self, name: str, expert: int | None = None) -> torch.Tensor:
        """The tensor dequantized to fp32 (`expert`: one expert of GPT-OSS's fused experts; the other families
        list each expert under its own name)."""
        t, e, kind = self._source[name]
        if self._arch == "gpt_oss" and kind in _EXPERTS:
            experts = [expert] if expert is not None else range(t.shape[0])
            out = torch.stack([self._gpt_oss_expert(t, kind, i).contiguous() for i in experts])
            return out[0] if expert is not None else out
        if kind == "attn_k_b":
            k_b = self._read(t).reshape(t.shape)  # [H, kv_lora, nope]
            v_b_info = self._file.tensors[t.name.replace("attn_k_b", "attn_v_b")]
            v_b = self._read(v_b_info).reshape(v_b_info.shape)  # [H, v, kv_lora]
            return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(self.shape(name)).contiguous()
        if self._arch == "qwen3_next" and kind in ("ssm_a", "attn_qkv", *_ZERO_CENTRED):
            return self._delta_net(t, kind, name)
        out = self._read(t, e).reshape(self.shape(name))
        if kind in self._permute:
            out = _unpermute(out, self._permute[kind])
        return out

    def _delta_net(self, t: TensorInfo, kind: str, name: str) -> torch.Tensor:
        """Qwen3-Next's tensors back from llama.cpp's form: A_log = log(-ssm_a), zero-centred norms less 1, and
        in_proj_qkvz's per-key-head [q, k, v, z] rows from attn_qkv (all q, all k, all v) and attn_gate (z)."""
        out = self._read(t).reshape(t.shape)
        if kind == "ssm_a":
            return torch.log(-out)
        if kind != "attn_qkv":
            return out - 1
        meta, arch = self._file.meta, "qwen3next"
        nk, dk = meta[f"{arch}.ssm.group_count"], meta[f"{arch}.ssm.state_size"]
        gate = self._file.tensors[t.name.replace("attn_qkv", "attn_gate")]
        z = self._read(gate).reshape(nk, -1, gate.shape[-1])  # [nk, per_v, H]
        q, k, v = out[: nk * dk].view(nk, dk, -1), out[nk * dk : 2 * nk * dk].view(nk, dk, -1), out[2 * nk * dk :]
        return torch.cat([q, k, v.reshape(nk, -1, out.shape[-1]), z], dim=1).reshape(self.shape(name)).contiguous()
