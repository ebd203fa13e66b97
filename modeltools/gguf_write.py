"""Write a Hugging Face MoE checkpoint as a GGUF file the way llama.cpp's convert_hf_to_gguf.py lays it out.

For tests and tools: tensor names from the gguf package's own map (`TensorNameMap` of the architecture),
per-expert weights stacked into `blk.N.ffn_{gate,up,down}_exps.weight` [E, ...], llama-arch (Mixtral) q/k
permuted for interleaved RoPE, DeepSeek's kv_b_proj split into `attn_k_b` / `attn_v_b`, Qwen3-Next's DeltaNet
tensors transformed as its converter does (`_delta_net_tensor`), 1-D tensors and the
router kept in F32, the other matrices in the requested type (F32, F16, BF16, Q8_0, Q4_0, ...) where their rows
fit its blocks; optionally split into shards as llama.cpp's gguf-split writes them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

from engine.gguf import ARCHS
from engine.gguf_file import shard_name

_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's q/k permutation (LlamaModel.permute in convert_hf_to_gguf.py)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _gguf_name(tmap, name: str) -> tuple[str, int | None]:
    """HF name -> (GGUF name by the gguf package's TensorNameMap of the architecture, expert index or None)."""
    name = name.replace("e_score_correction_bias", "e_score_correction.bias")  # as convert_hf_to_gguf renames it
    if name.endswith(".self_attn.sinks"):
        name += ".weight"  # llama.cpp loads blk.N.attn_sinks.weight
    m = _EXPERT_INDEX.search(name)
    key = _EXPERT_INDEX.sub(".experts.", name)
    gname = tmap.get_name(key, try_suffixes=(".weight", ".bias"))
    if gname is None:
        raise ValueError(f"no GGUF name for {name}")
    return gname, int(m.group(1)) if m else None


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


def write_gguf(hf_dir: str | Path, out: str | Path, qtype: str = "F32", shards: int = 1,
               experts_qtype: str | None = None) -> Path:
    """Converts the safetensors checkpoint in `hf_dir` to a GGUF file `out` with matrices in `qtype`; with
    `shards` > 1 to llama.cpp's split layout (`OUT-00001-of-0000N.gguf` ..., tensors spread evenly, the
    metadata in the first, `split.*` keys in each) and returns the first shard. `experts_qtype`: the routed
    experts' own type (GPT-OSS's are MXFP4 in llama.cpp's files)."""
    import gguf

    hf_dir, out = Path(hf_dir), Path(out)
    hf = json.loads((hf_dir / "config.json").read_text())
    if hf["model_type"] not in ARCHS:
        raise ValueError(f"no GGUF writer for {hf['model_type']!r} (written: {', '.join(ARCHS)})")
    arch = ARCHS[hf["model_type"]]
    tensors = _gguf_tensors(hf_dir, hf, arch, gguf.GGMLQuantizationType[qtype],
                            gguf.GGMLQuantizationType[experts_qtype] if experts_qtype else None)
    w = gguf.GGUFWriter(str(out), arch, split_max_tensors=-(-len(tensors) // shards) if shards > 1 else 0)
    _add_metadata(w, hf, arch)
    _add_tokenizer(w, hf_dir, hf["vocab_size"])
    for gname, (data, kind) in tensors.items():
        w.add_tensor(gname, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out if shards == 1 else out.with_name(shard_name(out.stem, 1, shards))


def _add_metadata(w, hf: dict, arch: str) -> None:
    import gguf

    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    heads, kv_heads = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    nextn = hf.get("num_nextn_predict_layers") or 0 if arch == "glm4moe" else 0
    w.add_block_count(hf["num_hidden_layers"] + nextn)  # convert_hf_to_gguf counts glm4moe's MTP blocks
    if nextn:
        w.add_nextn_predict_layers(nextn)
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(1 if arch == "deepseek2" else kv_heads)  # MLA stored as MQA over the latent
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_rope_freq_base(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    w.add_expert_count(hf.get("num_experts") or hf.get("n_routed_experts") or hf["num_local_experts"])
    w.add_expert_used_count(hf["num_experts_per_tok"])
    w.add_feed_forward_length(hf["intermediate_size"])
    if hf.get("head_dim") and arch != "deepseek2":
        w.add_key_length(hf["head_dim"])
        w.add_value_length(hf["head_dim"])
    if hf.get("moe_intermediate_size") or arch == "gpt-oss":
        w.add_expert_feed_forward_length(hf.get("moe_intermediate_size") or hf["intermediate_size"])
    if arch == "gpt-oss":
        w.add_sliding_window(hf["sliding_window"])
    if hf.get("norm_topk_prob") is not None and arch != "llama":
        w.add_expert_weights_norm(bool(hf["norm_topk_prob"]))
    if hf.get("clip_qkv"):
        w.add_clamp_kqv(hf["clip_qkv"])
    if arch in ("glm4moe", "deepseek2"):
        _add_routed(w, hf, arch)
    if arch == "qwen3next":
        _add_delta_net(w, hf)
    if hf.get("shared_expert_intermediate_size"):
        w.add_expert_shared_feed_forward_length(hf["shared_expert_intermediate_size"])
    if rope.get("rope_type", rope.get("type", "default")) in ("yarn", "linear"):
        w.add_rope_scaling_type(gguf.RopeScalingType(rope.get("rope_type", rope.get("type"))))
        w.add_rope_scaling_factor(rope["factor"])
        if rope.get("original_max_position_embeddings"):
            w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        if arch == "deepseek2" and rope.get("mscale_all_dim"):
            w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])  # llama.cpp assumes mscale equal
        for key in ("beta_fast", "beta_slow"):
            if rope.get(key) is not None and arch != "gpt-oss":  # llama.cpp fixes GPT-OSS's
                getattr(w, f"add_rope_scaling_yarn_{key}")(float(rope[key]))
    if hf.get("eos_token_id") is not None:
        eos = hf["eos_token_id"]
        w.add_eos_token_id(eos if isinstance(eos, int) else eos[0])


def _add_routed(w, hf: dict, arch: str) -> None:
    """glm4moe's and deepseek2's keys: shared experts, dense first layers, grouped sigmoid/softmax routing, MLA."""
    import gguf

    w.add_expert_shared_count(hf.get("n_shared_experts") or 0)
    w.add_leading_dense_block_count(hf.get("first_k_dense_replace") or 0)
    w.add_expert_weights_scale(float(hf.get("routed_scaling_factor", 1.0)))
    if (hf.get("n_group") or 1) > 1:
        w.add_expert_group_count(hf["n_group"])
        w.add_expert_group_used_count(hf.get("topk_group") or hf["n_group"])
    sigmoid = arch == "glm4moe" or hf["model_type"] != "deepseek_v2"
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX)
    if arch == "glm4moe":
        rope = hf.get("rope_parameters") or {}
        w.add_rope_dimension_count(int(hf["head_dim"] * rope.get("partial_rotary_factor", 1.0)))
        return
    if hf.get("q_lora_rank"):
        w.add_q_lora_rank(hf["q_lora_rank"])
    w.add_kv_lora_rank(hf["kv_lora_rank"])
    w.add_key_length(hf["kv_lora_rank"] + hf["qk_rope_head_dim"])
    w.add_value_length(hf["kv_lora_rank"])
    w.add_key_length_mla(hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"])
    w.add_value_length_mla(hf["v_head_dim"])
    w.add_rope_dimension_count(hf["qk_rope_head_dim"])


def _add_delta_net(w, hf: dict) -> None:
    """Qwen3-Next's keys as convert_hf_to_gguf writes them: the DeltaNet widths as `ssm.*`, the recurrent layers,
    the full-attention interval and the rotary dims of a head."""
    value_heads = hf["linear_num_value_heads"]
    w.add_ssm_conv_kernel(hf["linear_conv_kernel_dim"])
    w.add_ssm_state_size(hf["linear_key_head_dim"])
    w.add_ssm_group_count(hf["linear_num_key_heads"])
    w.add_ssm_time_step_rank(value_heads)
    w.add_ssm_inner_size(hf["linear_value_head_dim"] * value_heads)
    if hf.get("layer_types"):  # llama.cpp's `attention.recurrent_layers` (GGUFWriter.add_recurrent_layers)
        w.add_array(f"{w.arch}.attention.recurrent_layers", [t == "linear_attention" for t in hf["layer_types"]])
    w.add_full_attention_interval(hf.get("full_attention_interval", 4))
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 0.25)))


def _delta_net_tensor(hf: dict, gname: str, t: torch.Tensor) -> dict[str, np.ndarray]:
    """A Qwen3-Next tensor as convert_hf_to_gguf stores it: A_log as -exp(A_log), the conv squeezed to [C, K],
    zero-centred norms (all but the DeltaNet's gated norm) plus 1, in_proj_qkvz split into attn_qkv (all q, all
    k, all v) and attn_gate (z) from its per-key-head [q, k, v, z] rows."""
    if gname.endswith(".ssm_a"):
        return {gname: (-torch.exp(t)).numpy()}
    if "ssm_conv1d" in gname:
        return {gname: t.squeeze(1).numpy()}
    if gname.endswith("norm.weight") and ".ssm_norm." not in gname:
        return {gname: (t + 1).numpy()}
    if ".ssm_in." not in gname:
        return {gname: t.numpy()}
    dk, dv, nk = hf["linear_key_head_dim"], hf["linear_value_head_dim"], hf["linear_num_key_heads"]
    per_v = hf["linear_num_value_heads"] // nk * dv
    q, k, v, z = t.view(nk, 2 * dk + 2 * per_v, -1).split([dk, dk, per_v, per_v], dim=1)  # [nk, rows, H] each
    blk = gname.rsplit(".ssm_in.", 1)[0]
    qkv = torch.cat([x.reshape(-1, t.shape[-1]) for x in (q, k, v)])
    return {f"{blk}.attn_qkv.weight": qkv.numpy(), f"{blk}.attn_gate.weight": z.reshape(-1, t.shape[-1]).numpy()}


def _split_kv_b(hf: dict, kv_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b_proj [H * (nope + v), kv_lora] -> (k_b [H, kv_lora, nope], v_b [H, v, kv_lora]) as convert_hf_to_gguf."""
    heads, nope, v = hf["num_attention_heads"], hf["qk_nope_head_dim"], hf["v_head_dim"]
    k_b, v_b = kv_b.view(heads, nope + v, kv_b.shape[-1]).split([nope, v], dim=1)
    return k_b.transpose(1, 2).contiguous(), v_b.contiguous()


def _split_gpt_oss(blk: str, name: str, t: torch.Tensor) -> dict[str, np.ndarray]:
    """GPT-OSS's fused experts (gate_up [E, H, 2I] gate/up interleaved in columns, down [E, I, H], biases) as
    llama.cpp stores them: ffn_gate_exps / ffn_up_exps [E, I, H], ffn_down_exps [E, H, I], and their biases."""
    if "down_proj" in name:
        bias = t.dim() == 2
        return {f"{blk}.ffn_down_exps.{'bias' if bias else 'weight'}": (t if bias else t.transpose(1, 2)).numpy()}
    if t.dim() == 2:  # gate_up bias [E, 2I]
        return {f"{blk}.ffn_gate_exps.bias": t[:, 0::2].numpy(), f"{blk}.ffn_up_exps.bias": t[:, 1::2].numpy()}
    return {f"{blk}.ffn_gate_exps.weight": t[:, :, 0::2].transpose(1, 2).numpy(),
            f"{blk}.ffn_up_exps.weight": t[:, :, 1::2].transpose(1, 2).numpy()}


def _gguf_tensors(hf_dir: Path, hf: dict, arch: str, target, experts_target=None) -> dict[str, tuple[np.ndarray, object]]:
    """GGUF name -> (data, type), sorted by name: experts stacked, matrices in `target` where their rows fit."""
    import gguf
    from safetensors.torch import load_file

    heads, kv_heads = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    tmap = gguf.get_tensor_name_map({v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}[arch], hf["num_hidden_layers"])
    tensors: dict[str, np.ndarray] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        for name, t in load_file(str(path)).items():
            t = t.float()
            if arch == "gpt-oss" and ".mlp.experts." in name:
                tensors.update(_split_gpt_oss(f"blk.{name.split('.')[2]}", name, t))
                continue
            if arch == "qwen3next" and name.endswith(".linear_attn.dt_bias"):
                name = name.replace(".dt_bias", ".dt_proj.bias")  # as convert_hf_to_gguf renames it
            gname, expert = _gguf_name(tmap, name)
            if arch == "llama" and gname.endswith(("attn_q.weight", "attn_k.weight")):
                t = _permute(t, heads if "attn_q" in gname else kv_heads)
            if gname.endswith("attn_kv_b.weight"):  # newer convert_hf_to_gguf stores the per-head halves only
                k_b, v_b = _split_kv_b(hf, t)
                tensors[gname.replace("kv_b", "k_b")], tensors[gname.replace("kv_b", "v_b")] = k_b.numpy(), v_b.numpy()
            elif arch == "qwen3next" and expert is None:
                tensors.update(_delta_net_tensor(hf, gname, t))
            elif expert is None:
                tensors[gname] = t.numpy()
            else:
                experts.setdefault(gname, {})[expert] = t
    for gname, per in experts.items():
        tensors[gname] = torch.stack([per[e] for e in range(len(per))]).numpy()  # [E, rows, cols]
    out = {}
    for gname, array in sorted(tensors.items()):
        want = experts_target if experts_target is not None and gname.endswith("_exps.weight") else target
        keep = (array.ndim == 1 or gname.endswith(".bias") or ".ffn_gate_inp" in gname
                or array.shape[-1] % gguf.GGML_QUANT_SIZES[want][0])
        kind = gguf.GGMLQuantizationType.F32 if keep else want
        f32 = kind == gguf.GGMLQuantizationType.F32
        out[gname] = (array.astype(np.float32) if f32 else gguf.quants.quantize(array, kind), kind)
    return out
