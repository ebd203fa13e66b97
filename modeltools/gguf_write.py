"""Write a Hugging Face MoE checkpoint as a GGUF file the way llama.cpp's convert_hf_to_gguf.py lays it out.

For tests and tools: per-expert weights stacked into `blk.N.ffn_{gate,up,down}_exps.weight` [E, ...],
llama-arch (Mixtral) q/k permuted for interleaved RoPE, 1-D tensors and the router kept in F32, the
other matrices in the requested type (F32, F16, BF16, Q8_0, Q4_0, ...) where their rows fit its blocks.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from engine.gguf import _EXPERTS, _GLOBAL, _LAYER, ARCHS

_HF_TO_GGUF = {**{v: k for k, v in _LAYER.items()}, "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's q/k permutation (LlamaModel.permute in convert_hf_to_gguf.py)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _gguf_name(name: str) -> tuple[str, int | None, str | None]:
    """HF name -> (GGUF name, expert index or None, expert part or None)."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    for part in ("w1", "w3", "w2"):
        name = name.replace(f".{part}.weight", {"w1": ".gate_proj", "w3": ".up_proj", "w2": ".down_proj"}[part] + ".weight")
    stem, _, suffix = name.rpartition(".")
    for gguf_name, hf in _GLOBAL.items():
        if stem == hf:
            return f"{gguf_name}.{suffix}", None, None
    _, _, layer, rest = stem.split(".", 3)
    if rest.startswith("mlp.experts."):
        _, _, expert, part = rest.split(".")
        kind = {v: k for k, v in _EXPERTS.items()}[part]
        return f"blk.{layer}.{kind}.{suffix}", int(expert), kind
    return f"blk.{layer}.{_HF_TO_GGUF[rest]}.{suffix}", None, None


def _add_tokenizer(w, hf_dir: Path, vocab_size: int) -> None:
    """The byte-level BPE vocabulary of tokenizer.json as convert_hf_to_gguf.py stores it (ids past the
    tokenizer padded with unused [PADi] tokens), when its pre-tokenizer is one llama.cpp names."""
    import gguf

    from engine.gguf_tokenizer import _SPLIT, CONTROL, NORMAL, USER_DEFINED

    path = hf_dir / "tokenizer.json"
    if not path.is_file():
        return
    spec = json.loads(path.read_text(encoding="utf-8"))
    pre = json.dumps(spec.get("pre_tokenizer"))
    names = [name for name, (regex, _) in _SPLIT.items() if json.dumps(regex)[1:-1] in pre]
    if spec["model"]["type"] != "BPE" or not names:
        return
    tokens = {i: (t, NORMAL) for t, i in spec["model"]["vocab"].items()}
    tokens.update({a["id"]: (a["content"], CONTROL if a["special"] else USER_DEFINED) for a in spec["added_tokens"]})
    size = max(vocab_size, max(tokens) + 1)
    listed = [tokens.get(i, (f"[PAD{i}]", gguf.TokenType.UNUSED)) for i in range(size)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(names[0])
    w.add_token_list([t for t, _ in listed])
    w.add_token_types([int(k) for _, k in listed])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]])
    config = hf_dir / "tokenizer_config.json"
    template = json.loads(config.read_text(encoding="utf-8")).get("chat_template") if config.is_file() else None
    if isinstance(template, str):
        w.add_chat_template(template)


def write_gguf(hf_dir: str | Path, out: str | Path, qtype: str = "F32") -> Path:
    """Converts the safetensors checkpoint in `hf_dir` to one GGUF file `out` with matrices in `qtype`."""
    import gguf
    from safetensors.torch import load_file

    hf_dir, out = Path(hf_dir), Path(out)
    hf = json.loads((hf_dir / "config.json").read_text())
    arch = {v: k for k, v in ARCHS.items()}[hf["model_type"]]
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    heads, kv_heads = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(hf["num_hidden_layers"])
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_rope_freq_base(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    w.add_expert_count(hf.get("num_experts") or hf["num_local_experts"])
    w.add_expert_used_count(hf["num_experts_per_tok"])
    w.add_feed_forward_length(hf["intermediate_size"])
    if hf.get("head_dim"):
        w.add_key_length(hf["head_dim"])
        w.add_value_length(hf["head_dim"])
    if arch != "llama":
        w.add_expert_feed_forward_length(hf["moe_intermediate_size"])
    if hf.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(hf["shared_expert_intermediate_size"])
    if rope.get("rope_type", rope.get("type", "default")) in ("yarn", "linear"):
        w.add_rope_scaling_type(gguf.RopeScalingType(rope.get("rope_type", rope.get("type"))))
        w.add_rope_scaling_factor(rope["factor"])
        if rope.get("original_max_position_embeddings"):
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if hf.get("eos_token_id") is not None:
        eos = hf["eos_token_id"]
        w.add_eos_token_id(eos if isinstance(eos, int) else eos[0])

    _add_tokenizer(w, hf_dir, hf["vocab_size"])

    tensors: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        for name, t in load_file(str(path)).items():
            gname, expert, _ = _gguf_name(name)
            t = t.float()
            if arch == "llama" and gname.endswith(("attn_q.weight", "attn_k.weight")):
                t = _permute(t, heads if "attn_q" in gname else kv_heads)
            if expert is None:
                tensors[gname] = t.numpy()
            else:
                experts.setdefault(gname, {})[expert] = t
    for gname, per in experts.items():
        tensors[gname] = torch.stack([per[e] for e in range(len(per))]).numpy()  # [E, rows, cols]
    target = gguf.GGMLQuantizationType[qtype]
    block = gguf.GGML_QUANT_SIZES[target][0]
    for gname, array in sorted(tensors.items()):
        keep = array.ndim == 1 or ".ffn_gate_inp" in gname or array.shape[-1] % block
        kind = gguf.GGMLQuantizationType.F32 if keep else target
        data = array.astype(np.float32) if kind == gguf.GGMLQuantizationType.F32 else gguf.quants.quantize(array, kind)
        w.add_tensor(gname, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
