"""DeepSeek-V3/V2, Kimi-K2 and GLM-4.5 (DeepSeek-V3's routing over grouped-query attention) beyond the
fp32 parity of test_engine_parity: the latent KV cache, the prefix cache over it, Kimi-K2's model_type,
MTP tensors, routed experts through the packed CPU shards, random checkpoints, fast dense projections of
latent attention.

Quantized experts (teacher-forced along the fp32 model's greedy tokens, 4 prompts x 12 steps, tiny
random checkpoints): int8 within mean KL 0.01 nats of the fp32 model and top-1 equal on >= 90% of
steps; int4 within mean KL 0.05 and >= 75% (the deferral bound of test_engine_modes). Measured:
int8 mean KL ~1e-8 and top-1 100%, int4 ~1e-6 to 7e-6 and top-1 >= 97.9% (random routers and small
logits: the tiny models' drift is far inside the bounds).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import ModelConfig
from engine.experts import PlacementConfig
from engine.kv_cache import KVCacheSpec, allocate_kv_cache
from engine.llm_engine import LLM, EngineConfig, LLMEngine
from engine.loader import load_model
from engine.sampling_params import LogitsRecorder, SamplingParams
from tests.engine.conftest import drift, run_requests, teacher_forced_rows

STEPS = 12


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 500, (int(torch.randint(5, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _hf_tokens(path, prompt: list[int], steps: int = STEPS) -> list[int]:
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = ref.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, eos_token_id=None,
                       pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2", "glm4_moe"])
def test_init_random_checkpoint_matches_transformers(tiny_checkpoint, arch):
    """`moegate model init-random --arch deepseek_v3` (modeltools.random_checkpoint) writes what both engines run alike."""
    path = tiny_checkpoint(arch)
    cfg = ModelConfig.from_dir(path)
    assert cfg.moe_layers == (False, True) and cfg.n_group == 2
    assert cfg.attention == ("gqa" if arch == "glm4_moe" else "mla")
    prompt = _prompts(1, 17)[0]
    out = LLM(path, num_kv_blocks=16, block_size=8, progress=False).generate(
        [prompt], SamplingParams(max_tokens=STEPS, ignore_eos=True))[0]
    assert out.token_ids == _hf_tokens(path, prompt)


def test_latent_cache_holds_the_compressed_latent_only(hf_checkpoint):
    cfg = ModelConfig.from_dir(hf_checkpoint("deepseek_v3"))
    assert cfg.kv_cache_layout == (1, 1, 24 + 6)  # kv_lora_rank + qk_rope_head_dim, not per-head K and V
    kv = allocate_kv_cache(cfg, KVCacheSpec(4, 8), torch.float32, "cpu")
    assert len(kv) == 3 and all(len(layer) == 1 and layer[0].shape == (32, 1, 30) for layer in kv)
    assert KVCacheSpec.bytes_per_block(cfg, 8, torch.bfloat16) == 3 * 30 * 8 * 2
    expanded = 2 * cfg.num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)  # K + V per head, smaller of the two
    assert cfg.kv_cache_layout[2] * 3 < expanded


def test_absorbed_latent_attention_equals_the_expanded_form(hf_checkpoint):
    """Decode attends over the latents with kv_b_proj folded in; long chunks expand K and V per head."""
    attn = load_model(hf_checkpoint("deepseek_v3"), progress=False).model.layers[1].self_attn
    g = torch.Generator().manual_seed(0)
    for q_len, ctx in ((1, 1), (1, 37), (5, 37)):
        q = torch.randn(4, q_len, 16, generator=g)  # [NH, q, N+P]
        lat = torch.randn(ctx, 30, generator=g)  # [ctx, R+P]
        expanded = attn._attend(q, *attn._expand(lat))
        torch.testing.assert_close(attn._attend_absorbed(q, lat), expanded, rtol=1e-5, atol=1e-6)


def test_kimi_k2_loads_as_deepseek_v3(hf_checkpoint, tmp_path):
    src = hf_checkpoint("deepseek_v3")
    kimi = tmp_path / "kimi"
    shutil.copytree(src, kimi)
    config = json.loads((kimi / "config.json").read_text())
    config.update(model_type="kimi_k2", auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"})
    (kimi / "config.json").write_text(json.dumps(config))
    assert ModelConfig.from_dir(kimi).arch == "deepseek_v3"
    prompt = _prompts(1, 5)[0]
    out = LLM(kimi, num_kv_blocks=16, block_size=8, progress=False).generate(
        [prompt], SamplingParams(max_tokens=STEPS, ignore_eos=True))[0]
    assert out.token_ids == _hf_tokens(src, prompt)


def test_mtp_layers_past_the_stack_are_known_unused(hf_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "mtp"
    shutil.copytree(hf_checkpoint("deepseek_v3"), path)
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)  # DeepSeek-V3's MTP module follows layer 2
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    model = load_model(path, progress=False)
    assert len(model.model.layers) == 3


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2", "glm4_moe"])
def test_routed_experts_in_packed_cpu_shards_match_transformers(hf_checkpoint, arch):
    path = hf_checkpoint(arch)
    llm = LLM(path, num_kv_blocks=32, block_size=8, progress=False,
              placement=PlacementConfig(fast_format="fp32", exact_format="fp32"))
    assert sorted(llm.engine.layer_experts) == [1, 2]  # layer 0 is dense (first_k_dense_replace=1)
    prompts = _prompts(2, 11)
    outs = llm.generate(prompts, SamplingParams(max_tokens=STEPS, ignore_eos=True))
    assert [o.token_ids for o in outs] == [_hf_tokens(path, p) for p in prompts]


def test_prefix_cache_hit_over_latents_equals_a_cold_run(hf_checkpoint):
    path = hf_checkpoint("deepseek_v3")
    prompt = _prompts(1, 21)[0] * 3
    args = dict(num_kv_blocks=64, block_size=4, max_num_batched_tokens=16, progress=False)
    cold = LLM(path, prefix_cache=False, **args).generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))
    engine = LLMEngine(EngineConfig(str(path), **args))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    for rid in ("a", "b"):
        engine.add_request(rid, prompt, params)
        while engine.has_work():
            for out in engine.step():
                if out.finished:
                    final = out
        assert final.token_ids == cold[0].token_ids
    assert final.num_cached_tokens > 0
    block = engine.runner.read_block(0)
    assert tuple(block.shape) == (3, 1, 4, 1, 30)  # [layers, latent, block, 1, R + P]


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2", "glm4_moe"])
def test_quantized_experts_within_drift_bounds(hf_checkpoint, arch):
    path = hf_checkpoint(arch)
    prompts = _prompts(4, 31)
    args = dict(num_kv_blocks=64, block_size=8, progress=False)
    exact = LLM(path, **args)
    reference = [o.token_ids for o in exact.generate(prompts, SamplingParams(max_tokens=STEPS, ignore_eos=True))]
    base = teacher_forced_rows(exact, prompts, reference)
    kl_mean = {}
    for fmt, kl_bound, top1_bound in (("int8", 0.01, 0.9), ("int4", 0.05, 0.75)):
        quant = LLM(path, placement=PlacementConfig(fast_format=fmt, exact_format=fmt), **args)
        rows = teacher_forced_rows(quant, prompts, reference)
        assert not torch.equal(rows, base)  # the quantized experts really ran
        kl_mean[fmt], top1 = drift(rows, base)
        assert kl_mean[fmt] <= kl_bound
        assert top1 >= top1_bound
    assert kl_mean["int4"] > kl_mean["int8"]  # 4 bits drift further than 8


def test_fast_dense_latent_projections_and_fused_decode_declines(hf_checkpoint):
    path = hf_checkpoint("deepseek_v3")
    prompts = _prompts(3, 41)
    args = dict(num_kv_blocks=64, block_size=8, progress=False,
                placement=PlacementConfig(fast_format="fp32", exact_format="fp32"))
    fast = LLM(path, fast_dense="int8", **args)
    assert fast.engine.fused_decode is False  # MLA and grouped routing run the torch modules
    assert fast.engine.runner.model.model.layers[0].self_attn.fast_in is not None
    want = [_hf_tokens(path, p, 6) for p in prompts]
    got = [o.token_ids for o in fast.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))]
    agree = sum(a == b for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))
    assert agree >= 0.75 * 6 * len(prompts)
    # execution requests run the model's own projections: transformers' tokens exactly
    done = run_requests(fast.engine, [(f"x{i}", p, SamplingParams(max_tokens=6, ignore_eos=True), "execution")
                                      for i, p in enumerate(prompts)])
    assert [done[f"x{i}"] for i in range(len(prompts))] == want


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2", "glm4_moe"])
def test_yarn_long_context_matches_transformers(tmp_path, arch):
    """As DeepSeek-V3, Kimi-K2 and V2-Lite ship: YaRN over a prompt past the original context (MLA scales its
    softmax by mscale_all_dim squared; GLM-4.5 ropes only its rotary half)."""
    from tests.engine.conftest import write_hf_checkpoint

    rope = {**YARN, "partial_rotary_factor": 0.5} if arch == "glm4_moe" else YARN
    write_hf_checkpoint(tmp_path, arch, seed=3, rope_parameters=rope, max_position_embeddings=256)
    assert ModelConfig.from_dir(tmp_path).rope_scaling.rope_type == "yarn"
    prompt = torch.randint(1, 500, (150,), generator=torch.Generator().manual_seed(4)).tolist()
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    out = ref.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0,
                       output_logits=True, return_dict_in_generate=True)
    llm = LLM(tmp_path, num_kv_blocks=64, block_size=8, progress=False)
    rec = LogitsRecorder()
    got = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True, logits_processors=[rec]))[0]
    assert got.token_ids == out.sequences[0, len(prompt):].tolist()
    torch.testing.assert_close(torch.stack(rec.rows), torch.stack([lg[0] for lg in out.logits]), rtol=1e-4, atol=1e-4)
