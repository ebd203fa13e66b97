"""Tiny random Hugging Face checkpoints of each supported architecture, written by transformers."""

from __future__ import annotations

import pytest
import torch

ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
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
