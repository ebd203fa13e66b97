"""GGUF families beyond Qwen/Mixtral (olmoe, glm4moe, deepseek2, gpt-oss, qwen3next): quantized files against transformers running
the same dequantized weights, llama.cpp's layout variants (whole kv_b, nextn blocks), and a clear error for
an architecture moegate does not read."""

from __future__ import annotations

from dataclasses import replace

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import ModelConfig
from engine.errors import CheckpointError, UnexpectedTensorError, UnsupportedCheckpointError
from engine.gguf_file import open_gguf
from engine.llm_engine import LLM
from engine.loader import load_model
from engine.sampling_params import SamplingParams
from modeltools.gguf_write import write_gguf
from modeltools.sizing import ModelShape
from tests.engine.test_engine_gguf import _f32_fields, _gguf_dir, _hf_greedy, _hf_state, _rewrite

STEPS = 12


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return torch.randint(1, 511, (11,), generator=torch.Generator().manual_seed(11)).tolist()


def _greedy(model, prompt):
    llm = LLM(model, num_kv_blocks=32, block_size=8, progress=False)
    return llm.generate([prompt], SamplingParams(max_tokens=STEPS, ignore_eos=True))[0].token_ids


@pytest.mark.parametrize("arch, qtype", [("olmoe", "Q8_0"), ("glm4_moe", "Q8_0"), ("deepseek_v3", "Q8_0"),
                                         ("deepseek_v2", "Q8_0"), ("glm4_moe", "F16"), ("deepseek_v3", "F16"),
                                         ("deepseek_v3", "Q4_0")])
def test_quantized_gguf_family(hf_checkpoint, tmp_path, arch, qtype, prompt):
    """Greedy tokens equal transformers running the GGUF's dequantized weights; each weight within its
    type's step of the checkpoint, next-token logits within 0.05 of it (0.5 at Q4_0)."""
    src = hf_checkpoint(arch)
    path = _gguf_dir(src, tmp_path / "gguf", qtype)
    kinds = {n: gguf.GGMLQuantizationType(t.qtype).name for n, t in open_gguf(path / "model.gguf").tensors.items()}
    assert kinds["token_embd.weight"] == kinds["blk.1.ffn_gate_exps.weight"] == qtype
    a, b = load_model(path, progress=False), load_model(src, progress=False)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        if qtype == "Q8_0":  # step d = block amax / 127, stored as fp16: error <= d / 2 + 127 * d * 2**-11
            assert (p - q).abs().max() <= q.abs().max() / 127 * 0.57 + 1e-6, name
        elif qtype == "Q4_0":  # d = block amax / 8, the top code clipped from 8 to 7: error <= d (+ fp16 scale)
            assert (p - q).abs().max() <= q.abs().max() / 8 * 1.01 + 1e-6, name
        else:  # F16 matrices, F32 norms and routers
            assert torch.equal(p, q if p.dim() == 1 or ".mlp.gate." in name else q.half().float()), name
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ref.load_state_dict(_hf_state(a, ref), strict=True)
    out = ref.generate(torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False, eos_token_id=None,
                       pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    assert _greedy(path, prompt) == out.sequences[0, len(prompt):].tolist()
    _, ref_logits = _hf_greedy(src, prompt)
    assert (out.logits[0][0] - ref_logits).abs().max() < (0.05 if qtype != "Q4_0" else 0.5)


def test_deepseek_kv_b_whole_or_halves(hf_checkpoint, tmp_path, prompt):
    """Older files store attn_kv_b whole, some both it and the halves: the same weights either way; a half
    without its other half is an error naming it."""
    from safetensors.torch import load_file

    src = hf_checkpoint("deepseek_v3")
    split = _gguf_dir(src, tmp_path / "split", "F32") / "model.gguf"
    hf = {k: v for f in sorted(src.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    kv_b = [(f"blk.{i}.attn_kv_b.weight", hf[f"model.layers.{i}.self_attn.kv_b_proj.weight"].float().numpy())
            for i in range(3)]
    halves = [f"blk.{i}.attn_{k}_b.weight" for i in range(3) for k in "kv"]
    for name, drop in (("whole", halves), ("both", ())):
        (tmp_path / name).mkdir()
        _rewrite(split, tmp_path / name / "model.gguf", drop=drop, add=kv_b)
    expected = _greedy(tmp_path / "split", prompt)
    assert _greedy(tmp_path / "whole", prompt) == _greedy(tmp_path / "both", prompt) == expected
    (tmp_path / "half").mkdir()
    _rewrite(split, tmp_path / "half" / "model.gguf", drop=("blk.1.attn_v_b.weight",))
    with pytest.raises(CheckpointError, match=r"blk\.1\.attn_k_b\.weight has no blk\.1\.attn_v_b\.weight"):
        load_model(tmp_path / "half", progress=False)


def test_glm_nextn_blocks_are_unused(hf_checkpoint, tmp_path):
    """glm4moe counts its multi-token-prediction block in block_count (nextn_predict_layers): that block's
    tensors load as unused; the same tensor in a decoder layer is unexpected."""
    src = hf_checkpoint("glm4_moe")
    good = _gguf_dir(src, tmp_path / "good", "F32") / "model.gguf"
    meta = open_gguf(good).meta
    assert meta["glm4moe.block_count"] == 4 and meta["glm4moe.nextn_predict_layers"] == 1
    assert ModelConfig.from_dir(good).num_layers == 3
    eh = np.zeros((64, 128), np.float32)
    mtp = [("blk.3.nextn.eh_proj.weight", eh), ("blk.3.attn_norm.weight", eh[0])]
    for name, block, add, error in (("mtp", 3, mtp, None), ("stray", 2, mtp[:1], UnexpectedTensorError)):
        (tmp_path / name).mkdir()
        _rewrite(good, tmp_path / name / "model.gguf", add=[(n.replace("blk.3", f"blk.{block}"), a) for n, a in add])
        if error is None:
            load_model(tmp_path / name, progress=False)
        else:
            with pytest.raises(error, match=rf"blk\.{block}\.nextn\.eh_proj"):
                load_model(tmp_path / name, progress=False)


@pytest.mark.parametrize("arch", ["llama4", "qwen35moe", "deepseek"])
def test_unread_architecture_is_one_error(hf_checkpoint, tmp_path, arch):
    good = _gguf_dir(hf_checkpoint("qwen3_moe"), tmp_path / "good", "F32") / "model.gguf"
    (tmp_path / "other").mkdir()
    _rewrite(good, tmp_path / "other" / "model.gguf", arch=arch)
    with pytest.raises(UnsupportedCheckpointError, match=rf"GGUF architecture '{arch}' is not supported"):
        ModelConfig.from_dir(tmp_path / "other")


def test_gpt_oss_gguf(hf_checkpoint, tmp_path, prompt):
    """GPT-OSS as llama.cpp stores it (gate/up experts split, biases, sinks, the clamp fixed at 7): F32 loads
    the checkpoint's weights and gives transformers' greedy tokens; MXFP4 experts (llama.cpp's type for them)
    give the tokens of the engine on those weights dequantized, close to the F32 file's logits."""
    src = hf_checkpoint("gpt_oss", swiglu_limit=7.0, intermediate_size=32)  # rows of 32: MXFP4 blocks
    f32 = _gguf_dir(src, tmp_path / "f32", "F32")
    ours, ref_cfg = ModelConfig.from_dir(f32), ModelConfig.from_dir(src)
    assert _f32_fields(ours, ref_cfg) == ref_cfg
    gguf_shape, ref_shape = ModelShape.from_dir(f32), ModelShape.from_dir(src)  # what `moegate plan` sizes
    assert replace(gguf_shape, checkpoint_dtype=ref_shape.checkpoint_dtype) == ref_shape
    a, b = load_model(f32, progress=False), load_model(src, progress=False)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    expected, ref_logits = _hf_greedy(src, prompt)
    assert _greedy(f32, prompt) == expected[:STEPS]

    mx = tmp_path / "mx"
    mx.mkdir()
    write_gguf(src, mx / "model.gguf", "F32", experts_qtype="MXFP4")
    kinds = {n: gguf.GGMLQuantizationType(t.qtype).name for n, t in open_gguf(mx / "model.gguf").tensors.items()}
    assert kinds["blk.0.ffn_up_exps.weight"] == kinds["blk.0.ffn_down_exps.weight"] == "MXFP4"
    assert kinds["blk.0.ffn_up_exps.bias"] == kinds["blk.0.attn_q.weight"] == "F32"
    c = load_model(mx, progress=False)
    for (name, p), (_, q) in zip(c.named_parameters(), b.named_parameters(), strict=True):
        if ".experts." in name and not name.endswith("_bias"):  # e2m1 values, one power-of-two scale per 32
            assert 0 < (p - q).abs().max() <= q.abs().max() / 2, name
        else:
            assert torch.equal(p, q), name
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ref.load_state_dict(_gpt_oss_hf_state(c, ref), strict=True)
    out = ref.generate(torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False, eos_token_id=None,
                       pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    assert _greedy(mx, prompt) == out.sequences[0, len(prompt):].tolist()
    assert (out.logits[0][0] - ref_logits).abs().max() < 0.5  # 4-bit experts: near the F32 file's logits


def _gpt_oss_hf_state(ours, ref) -> dict[str, torch.Tensor]:
    """transformers' GPT-OSS state dict from the engine's parameters (router named gate, experts gate rows first)."""
    mine = {n.replace(".mlp.gate.", ".mlp.router."): p.detach() for n, p in ours.named_parameters()}
    state = {}
    for name, value in ref.state_dict().items():
        p = mine.get(name, value)
        if name.endswith("experts.gate_up_proj"):  # [E, 2I, H] -> [E, H, 2I], gate/up interleaved
            i = p.shape[1] // 2
            p = torch.stack([p[:, :i].transpose(1, 2), p[:, i:].transpose(1, 2)], dim=-1).flatten(2)
        elif name.endswith("experts.gate_up_proj_bias"):
            i = p.shape[1] // 2
            p = torch.stack([p[:, :i], p[:, i:]], dim=-1).flatten(1)
        elif name.endswith("experts.down_proj"):  # [E, H, I] -> [E, I, H]
            p = p.transpose(1, 2)
        assert p.shape == value.shape, name
        state[name] = p.contiguous()
    return state


def test_qwen3_next_gguf(hf_checkpoint, tmp_path, prompt):
    """Qwen3-Next as llama.cpp's converter writes it (A_log as -exp, norms plus 1, in_proj_qkvz split into
    attn_qkv / attn_gate, recurrent layers in the metadata): F32 gives the checkpoint's config, its weights to
    an ulp and transformers' greedy tokens; Q8_0 gives transformers' tokens on the dequantized weights."""
    src = hf_checkpoint("qwen3_next", mlp_only_layers=None)  # llama.cpp's qwen3next has no dense MLP layers
    f32 = _gguf_dir(src, tmp_path / "f32", "F32")
    names = set(open_gguf(f32 / "model.gguf").tensors)
    assert {"blk.0.ssm_a", "blk.0.attn_qkv.weight", "blk.0.attn_gate.weight", "blk.1.attn_q.weight"} <= names
    ours, ref_cfg = ModelConfig.from_dir(f32), ModelConfig.from_dir(src)
    assert _f32_fields(ours, ref_cfg) == ref_cfg
    gguf_shape, ref_shape = ModelShape.from_dir(f32), ModelShape.from_dir(src)
    assert replace(gguf_shape, checkpoint_dtype=ref_shape.checkpoint_dtype) == ref_shape
    a, b = load_model(f32, progress=False), load_model(src, progress=False)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=2.5e-7, msg=name)  # x + 1 - 1 and log(exp(x)) in fp32
    expected, _ = _hf_greedy(src, prompt)
    assert _greedy(f32, prompt) == expected[:STEPS]

    q8 = _gguf_dir(src, tmp_path / "q8", "Q8_0")
    c = load_model(q8, progress=False)
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ref.load_state_dict(_hf_state(c, ref), strict=True)
    out = ref.generate(torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False, eos_token_id=None,
                       pad_token_id=0, return_dict_in_generate=True)
    assert _greedy(q8, prompt) == out.sequences[0, len(prompt):].tolist()
