"""GGUF files (llama.cpp): config from metadata, tensors by name, dequantized; numerics against transformers
on the checkpoint the GGUF was written from."""

from __future__ import annotations

import shutil
from dataclasses import replace

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import ModelConfig
from engine.errors import MissingTensorError, UnexpectedTensorError, UnsupportedCheckpointError
from engine.gguf import GgufCheckpoint, find_gguf
from engine.llm_engine import LLM
from engine.loader import load_model
from engine.sampling_params import SamplingParams
from modeltools.gguf_write import write_gguf
from modeltools.sizing import ModelShape

STEPS = 16


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return torch.randint(1, 511, (13,), generator=torch.Generator().manual_seed(3)).tolist()


def _gguf_dir(src, dst, qtype):
    dst.mkdir(parents=True)
    write_gguf(src, dst / "model.gguf", qtype)
    return dst


def _hf_greedy(path, prompt):
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = ref.generate(torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False, eos_token_id=None,
                       pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), out.logits[0][0]


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_f32_gguf_is_the_checkpoint(hf_checkpoint, tmp_path, arch, prompt):
    """F32: the same weights (mixtral's q/k un-permuted), the same config, the same greedy tokens."""
    src = hf_checkpoint(arch)
    path = _gguf_dir(src, tmp_path / "gguf", "F32")
    ours, ref_cfg = ModelConfig.from_dir(path), ModelConfig.from_dir(src)
    assert np.float32(ours.rms_norm_eps) == np.float32(ref_cfg.rms_norm_eps)  # GGUF stores it as f32
    assert replace(ours, rms_norm_eps=ref_cfg.rms_norm_eps) == ref_cfg
    gguf_shape, ref_shape = ModelShape.from_dir(path), ModelShape.from_dir(src)  # what `moegate plan` sizes
    assert replace(gguf_shape, checkpoint_dtype=ref_shape.checkpoint_dtype) == ref_shape
    a, b = load_model(path, progress=False), load_model(src, progress=False)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    expected, _ = _hf_greedy(src, prompt)
    llm = LLM(path / "model.gguf", num_kv_blocks=32, block_size=8, progress=False)  # the file itself
    assert llm.generate([prompt], SamplingParams(max_tokens=STEPS, ignore_eos=True))[0].token_ids == expected


def test_yarn_gguf(write_checkpoint, tmp_path):
    """llama.cpp's rope.scaling.* keys: the same YaRN context and frequencies as the config.json."""
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10_000.0}
    write_checkpoint(tmp_path / "src", "qwen3_moe", seed=1, rope_parameters=rope, max_position_embeddings=256)
    path = _gguf_dir(tmp_path / "src", tmp_path / "gguf", "F32")
    ours, ref = ModelConfig.from_dir(path), ModelConfig.from_dir(tmp_path / "src")
    assert ours.rope_scaling == ref.rope_scaling and ours.max_position_embeddings == ref.max_position_embeddings


def test_q8_0_gguf_is_close(hf_checkpoint, tmp_path, prompt):
    src = hf_checkpoint("qwen3_moe")
    path = _gguf_dir(src, tmp_path / "gguf", "Q8_0")
    with open(path / "model.gguf", "rb"):
        kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path / "model.gguf")).tensors}
    assert kinds["blk.1.ffn_down_exps.weight"] == kinds["blk.0.attn_q.weight"] == "Q8_0"
    a, b = load_model(path, progress=False), load_model(src, progress=False)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        # Q8_0: one fp16 scale per 32 weights, amax -> 127: error at most half a step of the block's amax
        assert (p - q).abs().max() <= q.abs().max() / 127 * 0.51 + 1e-6, name
    # exact against transformers running the dequantized Q8_0 weights ...
    ref_q8 = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ref_q8.load_state_dict(_hf_state(a, ref_q8), strict=True)
    out = ref_q8.generate(torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False, eos_token_id=None,
                          pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    llm = LLM(path, num_kv_blocks=32, block_size=8, progress=False)
    tokens = llm.generate([prompt], SamplingParams(max_tokens=STEPS, ignore_eos=True))[0].token_ids
    assert tokens == out.sequences[0, len(prompt):].tolist()
    # ... and close to the unquantized checkpoint: next-token logits of the prompt
    _, ref_logits = _hf_greedy(src, prompt)
    assert (out.logits[0][0] - ref_logits).abs().max() < 0.05


def _hf_state(ours, ref) -> dict[str, torch.Tensor]:
    """transformers' state dict with our (dequantized) weights under its names (the same names and layout)."""
    mine = dict(ours.named_parameters())
    state = ref.state_dict()
    assert set(state) <= set(mine) | {"lm_head.weight"}, set(state) - set(mine)
    return {name: mine.get(name, value) for name, value in state.items()}


def test_tokenizer_json_beside_the_gguf(tmp_path):
    """A GGUF without a tokenizer takes the tokenizer.json beside it; without one, prompts are token ids."""
    from modeltools.random_checkpoint import write_random_checkpoint

    src = write_random_checkpoint(tmp_path / "src", hidden_size=64, num_layers=2, num_experts=4, top_k=2,
                                  moe_intermediate_size=32, num_heads=4, num_kv_heads=2, head_dim=16)
    full = _gguf_dir(src, tmp_path / "full", "Q8_0") / "model.gguf"
    (tmp_path / "bare").mkdir()
    _rewrite(full, tmp_path / "bare" / "model.gguf")  # the architecture's keys and tensors, no tokenizer
    assert LLM(tmp_path / "bare", num_kv_blocks=16, block_size=8, progress=False).engine.tokenizer is None
    shutil.copy(src / "tokenizer.json", tmp_path / "bare" / "tokenizer.json")
    llm = LLM(tmp_path / "bare" / "model.gguf", num_kv_blocks=16, block_size=8, progress=False)
    out = llm.generate(["hello"], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and out.text == llm.engine.tokenizer.decode(out.token_ids)


def _rewrite(src_gguf, dst_gguf, arch=None, drop=(), add=()):
    """Copies a GGUF file, changing its architecture name, dropping or adding tensors."""
    reader = gguf.GGUFReader(str(src_gguf))
    old_arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst_gguf), arch or old_arch)
    for name, field in reader.fields.items():
        if name.startswith(f"{old_arch}."):
            value, kind = field.contents(), gguf.GGUFValueType(field.types[0])
            w.add_key_value(name.replace(old_arch, arch or old_arch, 1), value, kind)
    for t in reader.tensors:
        if t.name not in drop:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    for name, array in add:
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_broken_gguf(hf_checkpoint, tmp_path):
    good = _gguf_dir(hf_checkpoint("qwen3_moe"), tmp_path / "good", "F32") / "model.gguf"
    cases = [
        ("arch", dict(arch="gemma3"), UnsupportedCheckpointError, "'gemma3'"),
        ("drop", dict(drop=("blk.1.ffn_up_exps.weight",)), MissingTensorError, r"layers\.1\.mlp\.experts\.0\.up_proj"),
        ("extra", dict(add=[("blk.0.attn_sinks.weight", np.zeros(4, np.float32))]), UnexpectedTensorError,
         r"blk\.0\.attn_sinks\.weight"),
    ]
    for name, change, error, match in cases:
        (tmp_path / name).mkdir()
        _rewrite(good, tmp_path / name / "m.gguf", **change)
        with pytest.raises(error, match=match):
            load_model(tmp_path / name, progress=False)
    shutil.copy(good, tmp_path / "good" / "other.gguf")
    with pytest.raises(UnsupportedCheckpointError, match="2 .gguf files"):
        find_gguf(tmp_path / "good")


@pytest.mark.parametrize("qtype, block_bytes, scale_at", [("Q4_K", 144, (0, 4)), ("Q6_K", 210, (208, 210))])
def test_k_quant_experts_read_one_at_a_time(tmp_path, qtype, block_bytes, scale_at):
    """K-quants (no Python quantizer): random blocks with sane scales; one expert read equals its slice."""
    experts, rows, cols = 3, 5, 512
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (experts, rows, cols // 256 * block_bytes), dtype=np.uint8)
    blocks = raw.reshape(-1, block_bytes)
    blocks[:, scale_at[0]:scale_at[1]] = np.full((scale_at[1] - scale_at[0]) // 2, 0.01, np.float16).view(np.uint8)
    kind = gguf.GGMLQuantizationType[qtype]
    w = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "qwen3moe")
    w.add_tensor("blk.0.ffn_gate_exps.weight", raw, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ckpt = GgufCheckpoint(tmp_path / "k.gguf", "qwen3_moe", 4, 2)
    full = gguf.quants.dequantize(raw, kind)  # [E, rows, cols]
    assert np.isfinite(full).all() and full.std() > 0
    for e in range(experts):
        name = f"model.layers.0.mlp.experts.{e}.gate_proj.weight"
        assert ckpt.shape(name) == (rows, cols)
        assert torch.equal(ckpt.get(name), torch.from_numpy(full[e]))


@pytest.mark.parametrize("vocab", ["bpe", "qwen"])
def test_tokenizer_from_gguf_metadata(tmp_path, vocab):
    """No tokenizer.json beside the file: the vocabulary, merges, special tokens and chat template the GGUF
    carries rebuild the same tokenizer."""
    from engine.tokenizer import Tokenizer
    from modeltools.random_checkpoint import write_random_checkpoint

    src = write_random_checkpoint(tmp_path / "src", hidden_size=32, num_layers=1, num_experts=4, top_k=2,
                                  moe_intermediate_size=32, num_heads=2, num_kv_heads=1, head_dim=16, vocab=vocab)
    path = _gguf_dir(src, tmp_path / "gguf", "F32")
    ours, ref = LLM(path / "model.gguf", num_kv_blocks=8, block_size=8, progress=False).engine.tokenizer, Tokenizer.from_dir(src)
    texts = ["Hello, world!  It's 2026-11-25.\n\n\tdef f(x):\n    return x**2", "naïve café — 東京 🚀 ½",
             "<|im_start|>user\nhi<tool_call>{\"a\": 1}</tool_call><|im_end|>", "   leading spaces and trailing   "]
    for text in texts:
        assert ours.encode(text) == ref.encode(text), text
        assert ours.decode(ref.encode(text)) == ref.decode(ref.encode(text))
    assert ours.chat_template == ref.chat_template
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == ref.apply_chat_template(
        messages, add_generation_prompt=True)
