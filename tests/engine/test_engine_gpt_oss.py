"""GPT-OSS beyond the fp32 parity of test_engine_parity: per-layer sliding / full attention and sinks, YaRN
against transformers' own YaRN, biased clamped-SwiGLU experts through the packed CPU shards and the
kernel, quantized experts, the prefix cache, random checkpoints and typed errors for bad checkpoints.

The tiny checkpoint (tests/engine/conftest.py): 3 layers sliding / full / sliding with a window of 5,
YaRN past its original 16 positions, prompts of 17 to 40 tokens. Quantized experts (teacher-forced along
the fp32 model's greedy tokens, 4 prompts x 12 steps): int8 within mean KL 0.01 nats of the fp32 model and
top-1 equal on >= 90% of steps; int4 within mean KL 0.05 and >= 75% (the bounds of test_engine_deepseek).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import ModelConfig
from engine.errors import CheckpointError, MissingTensorError, TensorShapeError
from engine.experts import PlacementConfig
from engine.llm_engine import LLM
from engine.loader import load_model
from engine.rope import RopeScaling, inv_freq
from engine.sampling_params import SamplingParams
from tests.engine.conftest import drift, run_requests, teacher_forced_rows

STEPS = 12


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 500, (int(torch.randint(17, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _hf_tokens(path, prompts: list[list[int]], steps: int = STEPS) -> list[list[int]]:
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return [ref.generate(torch.tensor([p]), max_new_tokens=steps, do_sample=False, eos_token_id=None,
                         pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def test_config_and_modules_follow_layer_types(hf_checkpoint):
    path = hf_checkpoint("gpt_oss")
    cfg = ModelConfig.from_dir(path)
    assert cfg.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert [cfg.window_of(i) for i in range(3)] == [5, None, 5]
    assert cfg.router == "topk_softmax" and cfg.expert_act == "swiglu_clamped" and cfg.swiglu_limit == 0.1
    assert cfg.rope_scaling.rope_type == "yarn"
    model = load_model(path, progress=False)
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [5, None, 5]
    assert model.model.layers[0].self_attn.sinks.abs().sum() > 0  # loaded, not left empty


@pytest.mark.parametrize("params", [
    dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=4096),
    dict(factor=4.0, original_max_position_embeddings=64),  # truncate defaults to true
    dict(factor=40.0, mscale=1.0, mscale_all_dim=0.707, original_max_position_embeddings=4096),
    dict(factor=8.0, attention_factor=1.3, beta_fast=16.0, original_max_position_embeddings=2048),
])
def test_yarn_matches_transformers(params):
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "rope_theta": 150000.0, **params}
    config = GptOssConfig(hidden_size=64, num_attention_heads=4, head_dim=18, rope_parameters=rope,
                          max_position_embeddings=int(params["factor"] * params["original_max_position_embeddings"]))
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    freq, factor = inv_freq(18, 150000.0, RopeScaling.from_hf(config.to_dict()))
    assert torch.equal(freq, want_freq.float()) and factor == pytest.approx(want_factor, rel=1e-12)


def test_routed_experts_in_packed_cpu_shards_match_transformers(hf_checkpoint):
    """Biases and the clamped SwiGLU run in the compiled kernel; the fused decode layer declines GPT-OSS."""
    path = hf_checkpoint("gpt_oss")
    llm = LLM(path, num_kv_blocks=64, block_size=8, progress=False,
              placement=PlacementConfig(fast_format="fp32", exact_format="fp32"))
    packed = llm.engine.layer_experts[0].fast[0].packed
    assert packed.has_bias and packed.act.kind == "swiglu_clamped" and packed.act.limit == pytest.approx(0.1)
    assert llm.engine.fused_decode is False
    prompts = _prompts(3, 11)
    outs = llm.generate(prompts, SamplingParams(max_tokens=STEPS, ignore_eos=True))
    assert [o.token_ids for o in outs] == _hf_tokens(path, prompts)


def test_fast_dense_attention_keeps_the_biases(hf_checkpoint):
    """Quantized q/k/v/o copies for exploration (as the example policies ask) with GPT-OSS's biases added at
    full precision: tokens close to transformers; execution runs the model's own projections, exactly."""
    path = hf_checkpoint("gpt_oss")
    llm = LLM(path, num_kv_blocks=64, block_size=8, progress=False, fast_dense="int8",
              placement=PlacementConfig(fast_format="fp32", exact_format="fp32"))
    attn = llm.engine.runner.model.model.layers[1].self_attn
    assert attn.fast_qkv is not None and attn.fast_o_bias is not None and llm.engine.fused_decode is False
    prompts = _prompts(3, 41)
    want = _hf_tokens(path, prompts, 6)
    got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))]
    assert sum(a == b for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True)) >= 0.75 * 18
    done = run_requests(llm.engine, [(f"x{i}", p, SamplingParams(max_tokens=6, ignore_eos=True), "execution")
                                     for i, p in enumerate(prompts)])
    assert [done[f"x{i}"] for i in range(len(prompts))] == want


@pytest.mark.parametrize(("fmt", "kl_bound", "top1_bound"), [("int8", 0.01, 0.9), ("int4", 0.05, 0.75)])
def test_quantized_experts_within_drift_bounds(hf_checkpoint, fmt, kl_bound, top1_bound):
    path = hf_checkpoint("gpt_oss")
    prompts = _prompts(4, 31)
    args = dict(num_kv_blocks=64, block_size=8, progress=False)
    exact = LLM(path, **args)
    reference = [o.token_ids for o in exact.generate(prompts, SamplingParams(max_tokens=STEPS, ignore_eos=True))]
    base = teacher_forced_rows(exact, prompts, reference)
    quant = LLM(path, placement=PlacementConfig(fast_format=fmt, exact_format=fmt), **args)
    rows = teacher_forced_rows(quant, prompts, reference)
    kl, top1 = drift(rows, base)
    assert 0 < kl <= kl_bound  # > 0: the quantized experts really ran
    assert top1 >= top1_bound


def test_prefix_cache_hit_with_sliding_layers_equals_a_cold_run(hf_checkpoint):
    path = hf_checkpoint("gpt_oss")
    prompt = _prompts(1, 21)[0][:20] * 2  # 40 tokens: blocks past the window of 5 are reused too
    args = dict(num_kv_blocks=64, block_size=4, max_num_batched_tokens=16, progress=False)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    cold = LLM(path, prefix_cache=False, **args).generate([prompt], params)[0]
    llm = LLM(path, **args)
    first, second = (llm.generate([prompt], params)[0] for _ in range(2))
    assert first.token_ids == second.token_ids == cold.token_ids == _hf_tokens(path, [prompt], 6)[0]
    assert second.num_cached_tokens > 0


def test_init_random_checkpoint_matches_transformers(tiny_checkpoint):
    """`moegate model init-random --arch gpt_oss` (modeltools.random_checkpoint) writes what both engines run alike."""
    path = tiny_checkpoint("gpt_oss")
    cfg = ModelConfig.from_dir(path)
    assert cfg.sliding_window == 8 and cfg.rope_scaling.factor == 32.0
    prompt = _prompts(1, 17)[0]
    out = LLM(path, num_kv_blocks=16, block_size=8, progress=False).generate(
        [prompt], SamplingParams(max_tokens=STEPS, ignore_eos=True))[0]
    assert out.token_ids == _hf_tokens(path, [prompt])[0]


def _edited(src, dst, config=None, tensors=None):
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, **config}))
    if tensors:
        state = load_file(dst / "model.safetensors")
        save_file(tensors(state) or state, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_bad_gpt_oss_checkpoints_are_typed_errors(hf_checkpoint, tmp_path):
    src = hf_checkpoint("gpt_oss")
    rope = {"rope_type": "ntk-by-parts", "rope_theta": 1e4, "factor": 2.0}
    with pytest.raises(CheckpointError, match="rope type 'ntk-by-parts' is not supported"):
        ModelConfig.from_dir(_edited(src, tmp_path / "rope", config={"rope_parameters": rope}))
    with pytest.raises(CheckpointError, match="layer_types"):
        ModelConfig.from_dir(_edited(src, tmp_path / "types", config={"layer_types": ["full_attention"]}))
    with pytest.raises(CheckpointError, match="swiglu_limit"):
        ModelConfig.from_dir(_edited(src, tmp_path / "limit", config={"swiglu_limit": 0}))

    def no_bias(state):
        del state["model.layers.1.mlp.experts.down_proj_bias"]

    with pytest.raises(MissingTensorError, match="down_proj_bias"):
        load_model(_edited(src, tmp_path / "bias", tensors=no_bias), progress=False)

    def ours(state):  # gate_up in the stack's own [E, 2I, H] layout instead of GPT-OSS's [E, H, 2I]
        name = "model.layers.0.mlp.experts.gate_up_proj"
        state[name] = state[name].transpose(1, 2).contiguous()

    with pytest.raises(TensorShapeError, match="gate_up_proj"):
        load_model(_edited(src, tmp_path / "layout", tensors=ours), progress=False)
