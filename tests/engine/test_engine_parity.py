"""Numerics against Hugging Face transformers on the same checkpoint.

Tolerances: fp32 logits within 1e-4 (max abs) at the prompt and at each of 32 decode steps;
greedy tokens identical. bf16: logits within 0.1 max abs of transformers' bf16 logits (bf16 keeps
8 bits of mantissa: different but equally valid summation orders move logits of magnitude ~3 by up
to a few 1e-2) and top-1 agreement on at least 90% of steps.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.forward_batch import ForwardBatch
from engine.kv_cache import KVCacheSpec, allocate_kv_cache
from engine.llm_engine import LLM
from engine.loader import load_model
from engine.recurrent_state import RecurrentStates, layer_caches
from engine.sampling_params import SamplingParams

ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "deepseek_v2", "glm4_moe", "gpt_oss",
         "qwen3_next")
VOCAB = 512  # the tiny checkpoints of tests/engine/conftest.py

STEPS = 32


def _hf_greedy(path, prompt: list[int], dtype: torch.dtype):
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    out = ref.generate(
        torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False, eos_token_id=None,
        output_logits=True, return_dict_in_generate=True, pad_token_id=0,
    )
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, torch.stack([lg[0].float() for lg in out.logits])  # [STEPS, V]


def _our_logits(path, prompt: list[int], tokens: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Prefill the prompt, then feed `tokens` one at a time through the paged cache. -> [STEPS, V]"""
    model = load_model(path, dtype=dtype, progress=False)
    block_size = 8
    cfg = model.config
    states = RecurrentStates(cfg, 1, 0, block_size, "cpu") if cfg.linear_attention else None  # slot 0
    kv = layer_caches(cfg, allocate_kv_cache(cfg, KVCacheSpec(16, block_size), dtype, "cpu"), states)
    table = [5, 2, 9, 0, 7, 11]  # scattered blocks: the block table must be honoured
    rows = []
    with torch.inference_mode():
        hidden = model(ForwardBatch.single(prompt, table, block_size), kv)
        rows.append(model.compute_logits(hidden[-1:])[0])
        for i, t in enumerate(tokens[:-1]):
            batch = ForwardBatch.single([t], table, block_size, start=len(prompt) + i)
            rows.append(model.compute_logits(model(batch, kv))[0])
    return torch.stack(rows)


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return torch.randint(1, VOCAB - 1, (13,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_logits_match_transformers(hf_checkpoint, arch, prompt):
    path = hf_checkpoint(arch)
    tokens, ref = _hf_greedy(path, prompt, torch.float32)
    ours = _our_logits(path, prompt, tokens, torch.float32)
    assert (ours - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generation_matches_transformers(hf_checkpoint, arch, prompt):
    path = hf_checkpoint(arch)
    tokens, _ = _hf_greedy(path, prompt, torch.float32)
    llm = LLM(path, num_kv_blocks=32, block_size=8, progress=False)
    out = llm.generate([prompt], SamplingParams(max_tokens=STEPS, ignore_eos=True))[0]
    assert out.token_ids == tokens
    assert out.finish_reason == "length"


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "deepseek_v3", "deepseek_v2", "glm4_moe", "qwen3_next"])
def test_bf16_within_documented_tolerance(hf_checkpoint, arch, prompt):
    path = hf_checkpoint(arch)
    tokens, ref = _hf_greedy(path, prompt, torch.bfloat16)
    ours = _our_logits(path, prompt, tokens, torch.bfloat16)
    assert (ours - ref).abs().max().item() <= 0.1
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.9


def test_per_expert_and_fused_layouts_load_the_same(hf_checkpoint, tmp_path):
    """A checkpoint saved with fused expert tensors loads to the same weights as the hub layout."""
    from safetensors.torch import load_file, save_file

    path = hf_checkpoint("qwen3_moe")
    tensors = load_file(str(path / "model.safetensors"))
    fused = {}
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts"
        gate_up = [torch.cat([tensors.pop(f"{p}.{e}.gate_proj.weight"), tensors.pop(f"{p}.{e}.up_proj.weight")])
                   for e in range(8)]
        fused[f"{p}.gate_up_proj"] = torch.stack(gate_up)
        fused[f"{p}.down_proj"] = torch.stack([tensors.pop(f"{p}.{e}.down_proj.weight") for e in range(8)])
    save_file({**tensors, **fused}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    a, b = load_model(path, progress=False), load_model(tmp_path, progress=False)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert na == nb and torch.equal(pa, pb), na


def test_sliding_window_matches_transformers(hf_checkpoint, prompt):
    path = hf_checkpoint("mixtral", sliding_window=8)
    tokens, ref = _hf_greedy(path, prompt, torch.float32)
    ours = _our_logits(path, prompt, tokens, torch.float32)
    assert (ours - ref).abs().max().item() <= 1e-4


def test_tied_embeddings_match_transformers(hf_checkpoint, prompt):
    path = hf_checkpoint("qwen3_moe", tie_word_embeddings=True)
    tokens, ref = _hf_greedy(path, prompt, torch.float32)
    ours = _our_logits(path, prompt, tokens, torch.float32)
    assert (ours - ref).abs().max().item() <= 1e-4
