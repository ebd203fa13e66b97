"""Tiny random Hugging Face checkpoints of each supported architecture, written by transformers."""

from __future__ import annotations

import pytest
import torch

ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "deepseek_v2", "glm4_moe", "gpt_oss",
         "qwen3_next")
VOCAB = 512


def write_hf_checkpoint(path, arch: str, seed: int = 0, **overrides) -> None:
    import transformers as tf

    common = dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=512,
        eos_token_id=VOCAB - 1, pad_token_id=0,
    )
    specs = {
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                      dict(num_experts=8, moe_intermediate_size=32, head_dim=16, norm_topk_prob=True)),
        "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                      dict(num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=40,
                           intermediate_size=48)),
        "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=8, intermediate_size=32)),
        "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=8, intermediate_size=32)),
        # odd MLA sizes: q through a LoRA (q_lora_rank) or direct, latent 24 + rope 6, nope 10, v 12;
        # one dense layer first, 8 experts in 4 groups of which the best 2 are kept, 2 shared experts
        "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
            num_hidden_layers=3, num_key_value_heads=4, n_routed_experts=8, moe_intermediate_size=24,
            intermediate_size=40, q_lora_rank=20, kv_lora_rank=24, qk_nope_head_dim=10, qk_rope_head_dim=6,
            v_head_dim=12, n_group=4, topk_group=2, n_shared_experts=2, first_k_dense_replace=1,
            routed_scaling_factor=2.5, norm_topk_prob=True)),
        "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
            num_hidden_layers=3, num_key_value_heads=4, n_routed_experts=8, moe_intermediate_size=24,
            intermediate_size=40, q_lora_rank=None, kv_lora_rank=24, qk_nope_head_dim=10, qk_rope_head_dim=6,
            v_head_dim=12, n_group=4, topk_group=2, topk_method="group_limited_greedy", n_shared_experts=2,
            first_k_dense_replace=1, routed_scaling_factor=1.5)),
        # GLM-4.5: head_dim 20 with half of it rotary, q/k/v biases, per-head q/k norms
        "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
            num_hidden_layers=3, head_dim=20, n_routed_experts=8, moe_intermediate_size=24, intermediate_size=40,
            n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=1.8,
            attention_bias=True, use_qk_norm=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
        # sliding / full / sliding layers with a window shorter than the prompts, YaRN past its original 16
        # positions, odd head_dim 18 and expert width 40, a SwiGLU limit small enough that both clamps bite
        "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
            num_hidden_layers=3, num_local_experts=6, intermediate_size=40, head_dim=18, sliding_window=5,
            max_position_embeddings=64,
            swiglu_limit=0.1, rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                               "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                               "original_max_position_embeddings": 16})),
        # linear / full / dense linear / linear layers; 2 key heads of 12 serving 6 value heads of 10, conv kernel 4;
        # gated full attention with head_dim 24, a quarter of it rotary; a sigmoid-gated shared expert
        "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
            num_hidden_layers=4, layer_types=["linear_attention", "full_attention", "linear_attention",
                                              "linear_attention"],
            head_dim=24, num_experts=8, moe_intermediate_size=24, shared_expert_intermediate_size=40,
            intermediate_size=48, mlp_only_layers=[2], norm_topk_prob=True, linear_num_key_heads=2,
            linear_num_value_heads=6, linear_key_head_dim=12, linear_value_head_dim=10, linear_conv_kernel_dim=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})),
    }
    config_cls, model_cls, arch_kw = specs[arch]
    config = getattr(tf, config_cls)(**{**common, **arch_kw, **overrides})
    torch.manual_seed(seed)
    model = getattr(tf, model_cls)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # random norm weights so a wrong norm placement shows in the logits
                p.normal_(1.0, 0.1)
            elif "bias" in name:
                p.normal_(0.0, 0.05)
            elif name.endswith("sinks"):  # GPT-OSS: sink logits that take a visible share of attention
                p.normal_(0.0, 1.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a real bias so it steers the choice
                b.normal_(0.0, 0.05)
    model.save_pretrained(path, safe_serialization=True)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    cache: dict[tuple, object] = {}

    def make(arch: str, **overrides):
        key = (arch, tuple(sorted(overrides.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(arch)
            write_hf_checkpoint(path, arch, **overrides)
            cache[key] = path
        return cache[key]

    return make


@pytest.fixture(scope="session")
def write_checkpoint():
    """write_hf_checkpoint(path, arch, seed, **config overrides) for tests that need their own config."""
    return write_hf_checkpoint


def run_requests(engine, requests) -> dict[str, list[int]]:
    """Adds (id, prompt, params, mode) requests to `engine` and steps it until idle -> {id: output token ids}."""
    for rid, prompt, params, mode in requests:
        engine.add_request(rid, prompt, params, mode=mode)
    done = {}
    while engine.has_work():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return done


def teacher_forced_rows(llm, prompts, reference) -> torch.Tensor:
    """The logits rows `llm` gives along `reference` (each prompt's continuation, fed token by token)."""
    from engine.sampling_params import SamplingParams
    from evals.perf.modes_bench import TeacherForcing

    procs = [TeacherForcing(ref) for ref in reference]
    llm.generate(prompts, [SamplingParams(max_tokens=len(r), ignore_eos=True, logits_processors=[p])
                           for r, p in zip(reference, procs, strict=True)])
    return torch.cat([torch.stack(p.rows) for p in procs])


def drift(rows: torch.Tensor, base: torch.Tensor) -> tuple[float, float]:
    """(mean KL(base || rows) in nats, share of rows whose top-1 agrees with base's) over teacher-forced rows."""
    rows, base = rows.double(), base.double()  # fp32 rounding would swamp the KL of near-identical rows
    kl = torch.nn.functional.kl_div(rows.log_softmax(-1), base.log_softmax(-1), log_target=True,
                                    reduction="none").sum(-1)
    return kl.mean().item(), (rows.argmax(-1) == base.argmax(-1)).float().mean().item()


def random_prompts(n: int, seed: int) -> list[list[int]]:
    """`n` prompts of 4-29 ids in [1, 500), seeded."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 500, (int(torch.randint(4, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def format_drift(path, prompts, runs: dict[str, dict], steps: int = 8):
    """Teacher-forced logits rows of each run (`fmt`: the routed experts' format, the rest LLM keyword arguments)
    along the fp32 engine's greedy continuations, and each run's (KL, top-1) drift against the fp32 rows."""
    from engine.experts import PlacementConfig
    from engine.llm_engine import LLM
    from engine.sampling_params import SamplingParams

    args = dict(num_kv_blocks=128, block_size=8, progress=False)
    exact = LLM(path, **args)
    reference = [o.token_ids for o in exact.generate(prompts, SamplingParams(max_tokens=steps, ignore_eos=True))]
    base = teacher_forced_rows(exact, prompts, reference)
    rows, kl, top1 = {}, {}, {}
    for name, run in runs.items():
        cfg = dict(run)
        fmt = cfg.pop("fmt")
        llm = LLM(path, placement=PlacementConfig(fast_format=fmt, exact_format=fmt), **cfg, **args)
        rows[name] = teacher_forced_rows(llm, prompts, reference)
        kl[name], top1[name] = drift(rows[name], base)
    print({name: (f"KL {kl[name]:.2e}", f"top-1 {top1[name]:.3f}") for name in runs})
    return rows, kl, top1
