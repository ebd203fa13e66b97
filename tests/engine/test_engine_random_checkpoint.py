"""modeltools.random_checkpoint + `moegate model init-random`: random MoE checkpoints that transformers loads."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from safetensors import safe_open

from engine.tokenizer import Tokenizer
from modeltools import model_cli
from modeltools.random_checkpoint import ARCHS, RandomCheckpointError, write_random_checkpoint

# Per arch: (config key holding the expert count, a per-expert tensor, a router tensor, extra tensors).
EXPECTED_NAMES = {
    "qwen3_moe": ("num_local_experts", "mlp.experts.7.down_proj.weight", "mlp.gate.weight",
                  ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]),
    "qwen2_moe": ("num_experts", "mlp.experts.7.up_proj.weight", "mlp.gate.weight",
                  ["mlp.shared_expert.gate_proj.weight", "mlp.shared_expert_gate.weight", "self_attn.q_proj.bias"]),
    "mixtral": ("num_local_experts", "block_sparse_moe.experts.7.w2.weight", "block_sparse_moe.gate.weight", []),
    "olmoe": ("num_experts", "mlp.experts.7.gate_proj.weight", "mlp.gate.weight",
              ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]),
    "deepseek_v3": ("n_routed_experts", "mlp.experts.7.down_proj.weight", "mlp.gate.weight",
                    ["self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_b_proj.weight",
                     "mlp.shared_experts.gate_proj.weight", "mlp.gate.e_score_correction_bias"]),
    "deepseek_v2": ("n_routed_experts", "mlp.experts.7.up_proj.weight", "mlp.gate.weight",
                    ["self_attn.kv_a_layernorm.weight", "mlp.shared_experts.down_proj.weight"]),
    "glm4_moe": ("n_routed_experts", "mlp.experts.7.gate_proj.weight", "mlp.gate.weight",
                 ["self_attn.q_norm.weight", "self_attn.k_proj.bias", "mlp.shared_experts.up_proj.weight",
                  "mlp.gate.e_score_correction_bias"]),
    "gpt_oss": ("num_local_experts", "mlp.experts.gate_up_proj", "mlp.router.weight",
                ["mlp.router.bias", "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias", "self_attn.sinks",
                 "self_attn.o_proj.bias"]),
    "qwen3_next": ("num_experts", "mlp.experts.7.down_proj.weight", "mlp.gate.weight",  # layer 1 of 2: full attention
                   ["self_attn.q_norm.weight", "mlp.shared_expert_gate.weight"]),
}


def _tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_and_runs_each_arch(tiny_checkpoint, arch):
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint(arch)
    cfg = json.loads((path / "config.json").read_text())
    tok = Tokenizer.from_dir(path)
    experts_key, expert_tensor, router_tensor, extra = EXPECTED_NAMES[arch]
    assert cfg["model_type"] == arch and cfg[experts_key] == 8 and cfg["num_experts_per_tok"] == 2
    assert cfg["vocab_size"] % 64 == 0 and tok.vocab_size <= cfg["vocab_size"] < tok.vocab_size + 64
    assert cfg["eos_token_id"] == tok.token_to_id("<|im_end|>")
    assert tok.eos_token_ids == [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]

    names = set(_tensors(path))
    for suffix in [expert_tensor, router_tensor, *extra]:
        assert f"model.layers.1.{suffix}" in names
    assert not any("experts.8." in n for n in names)

    model = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = torch.tensor([tok.encode_chat([{"role": "user", "content": "Quote AAPL in €"}])])
    with torch.no_grad():
        logits = model(ids).logits  # [1, T, V]
    assert logits.shape == (1, ids.shape[1], cfg["vocab_size"])
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_arch_specific_shapes(tiny_checkpoint):
    qwen3 = _tensors(tiny_checkpoint("qwen3_moe", head_dim=32))
    assert qwen3["model.layers.0.self_attn.q_norm.weight"].shape == (32,)  # per head
    assert qwen3["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 64)
    olmoe = _tensors(tiny_checkpoint("olmoe"))
    assert olmoe["model.layers.0.self_attn.q_norm.weight"].shape == (64,)  # across all heads
    assert olmoe["model.layers.0.self_attn.k_norm.weight"].shape == (32,)  # kv heads * head_dim
    qwen2 = _tensors(tiny_checkpoint("qwen2_moe"))
    assert qwen2["model.layers.0.mlp.shared_expert.up_proj.weight"].shape == (4 * 32, 64)
    assert qwen2["model.layers.0.mlp.shared_expert_gate.weight"].shape == (1, 64)
    mixtral = _tensors(tiny_checkpoint("mixtral"))
    assert mixtral["model.layers.0.block_sparse_moe.experts.0.w1.weight"].shape == (32, 64)
    # Norms and biases are perturbed away from their 1 / 0 init so a loader mix-up shows.
    norm = qwen3["model.layers.0.input_layernorm.weight"]
    assert not torch.equal(norm, torch.ones_like(norm))
    assert not torch.equal(qwen2["model.layers.0.self_attn.q_proj.bias"], qwen2["model.layers.1.self_attn.q_proj.bias"])


def test_seeded_and_dtype(tmp_path, tiny_checkpoint):
    base = _tensors(tiny_checkpoint("mixtral"))
    again = _tensors(write_random_checkpoint(tmp_path / "again", "mixtral", **_tiny()))
    assert base.keys() == again.keys() and all(torch.equal(base[k], again[k]) for k in base)
    other = _tensors(write_random_checkpoint(tmp_path / "other", "mixtral", **{**_tiny(), "seed": 1}))
    assert not torch.equal(base["model.embed_tokens.weight"], other["model.embed_tokens.weight"])
    bf16 = _tensors(write_random_checkpoint(tmp_path / "bf16", "mixtral", **{**_tiny(), "dtype": "bfloat16"}))
    assert all(t.dtype == torch.bfloat16 for t in bf16.values())
    assert torch.equal(bf16["model.layers.0.block_sparse_moe.experts.3.w2.weight"],
                       base["model.layers.0.block_sparse_moe.experts.3.w2.weight"].to(torch.bfloat16))


def _tiny() -> dict:
    from tests.conftest import TINY_SIZES

    return dict(TINY_SIZES)


def test_arch_options_reach_the_config(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint("qwen3_moe", num_layers=3, mlp_only_layers=[1], norm_topk_prob=False, rope_theta=5e5)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["mlp_only_layers"] == [1] and cfg["norm_topk_prob"] is False
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 5e5}
    names = set(_tensors(path))
    assert "model.layers.1.mlp.gate_proj.weight" in names  # dense layer
    assert "model.layers.1.mlp.gate.weight" not in names
    assert "model.layers.2.mlp.gate.weight" in names
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


def test_invalid_options_are_rejected(tmp_path):
    with pytest.raises(RandomCheckpointError, match="no field"):
        write_random_checkpoint(tmp_path, "mixtral", **_tiny(), shared_expert_intermediate_size=8)
    with pytest.raises(RandomCheckpointError, match="head_dim"):
        write_random_checkpoint(tmp_path, "olmoe", **{**_tiny(), "head_dim": 32})
    with pytest.raises(RandomCheckpointError, match="arch"):
        write_random_checkpoint(tmp_path, "llama", **_tiny())
    with pytest.raises(RandomCheckpointError, match="top_k"):
        write_random_checkpoint(tmp_path, "qwen3_moe", **{**_tiny(), "top_k": 9})
    with pytest.raises(RandomCheckpointError, match="vocab"):
        write_random_checkpoint(tmp_path, "qwen3_moe", **{**_tiny(), "vocab": "gpt2"})


def test_chat_template_renders_tools_for_every_arch(tiny_checkpoint):
    tools = [{"type": "function", "function": {"name": "get_quote", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "AAPL?"},
                {"role": "assistant", "tool_calls": [{"function": {"name": "get_quote", "arguments": {"t": "AAPL"}}}]},
                {"role": "tool", "content": "189.84"}]
    rendered = {Tokenizer.from_dir(tiny_checkpoint(arch)).apply_chat_template(messages, tools=tools) for arch in ARCHS}
    assert len(rendered) == 1  # the same template everywhere
    text = rendered.pop()
    assert '<tools>\n{"type": "function", "function": {"name": "get_quote"' in text
    assert '<tool_call>\n{"name": "get_quote", "arguments": {"t": "AAPL"}}\n</tool_call><|im_end|>' in text
    assert "<tool_response>\n189.84\n</tool_response>" in text


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="moegate")
    model_cli.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_cli_init_random(tmp_path, capsys):
    out = tmp_path / "ckpt"
    args = _parse(["model", "init-random", "--arch", "olmoe", "--out", str(out), "--layers", "1",
                   "--experts", "4", "--top-k", "1", "--seed", "3"])
    assert args.func(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["num_layers"] == 1 and summary["hidden_size"] == 64 and summary["dtype"] == "float32"
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["model_type"], cfg["num_hidden_layers"], cfg["num_experts"], cfg["num_experts_per_tok"]) == \
        ("olmoe", 1, 4, 1)
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()


def test_cli_bench_preset_is_the_reference_model(tmp_path):
    kw = model_cli.checkpoint_kwargs(_parse(["model", "init-random", "--preset", "bench", "--out", str(tmp_path)]))
    assert kw == dict(hidden_size=1024, num_layers=8, num_experts=64, top_k=8, moe_intermediate_size=512,
                      num_heads=16, num_kv_heads=4, vocab="qwen", dtype="bfloat16")
    kw = model_cli.checkpoint_kwargs(_parse(["model", "init-random", "--preset", "bench", "--out", str(tmp_path),
                                             "--layers", "2", "--dtype", "float32"]))
    assert kw["num_layers"] == 2 and kw["dtype"] == "float32" and kw["num_experts"] == 64
