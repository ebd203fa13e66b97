"""`moegate plan`: exact parameter counts per arch, sizes against a real load, CLI output and errors."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from modeltools import plan as plan_mod
from modeltools.gguf_write import write_gguf
from modeltools.plan import GIB, PRECISIONS, PlanOptions, build_plan, measure_bandwidth
from modeltools.sizing import EMBED, LM_HEAD, ROUTED, ModelShape, SizingError, census, params_by_part

transformers = pytest.importorskip("transformers")

QWEN3_30B_A3B = {  # numbers of Qwen/Qwen3-30B-A3B config.json
    "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
    "moe_intermediate_size": 768, "intermediate_size": 6144, "vocab_size": 151936,
    "tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": [], "torch_dtype": "bfloat16",
}


def _tiny_configs():
    t = transformers
    common = dict(vocab_size=1000, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    return {
        # attention_bias + a dense layer + explicit head_dim exercise the optional Qwen3 parts
        "qwen3_moe": t.Qwen3MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32,
                                      num_hidden_layers=4, head_dim=24, num_experts=8, num_experts_per_tok=2,
                                      mlp_only_layers=[1], attention_bias=True),
        # shared expert, qkv bias, sparse every 2nd layer, tied embeddings
        "qwen2_moe": t.Qwen2MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32,
                                      shared_expert_intermediate_size=80, num_hidden_layers=4, num_experts=8,
                                      num_experts_per_tok=2, decoder_sparse_step=2, tie_word_embeddings=True),
        "mixtral": t.MixtralConfig(**common, intermediate_size=32, num_hidden_layers=3, num_local_experts=8,
                                   num_experts_per_tok=2),
        "olmoe": t.OlmoeConfig(**common, intermediate_size=32, num_hidden_layers=3, num_experts=8,
                               num_experts_per_tok=2, eos_token_id=0, pad_token_id=1),
        # MLA with a q LoRA and biases, grouped routing with the score-correction bias, 2 shared experts
        "deepseek_v3": t.DeepseekV3Config(**{**common, "num_key_value_heads": 4}, intermediate_size=48,
                                          moe_intermediate_size=24, num_hidden_layers=3, n_routed_experts=8,
                                          num_experts_per_tok=2, n_group=2, topk_group=1, q_lora_rank=20,
                                          kv_lora_rank=24, qk_nope_head_dim=10, qk_rope_head_dim=6, v_head_dim=12,
                                          n_shared_experts=2, first_k_dense_replace=1, attention_bias=True),
        # direct q_proj, softmax routing, untied
        "deepseek_v2": t.DeepseekV2Config(**{**common, "num_key_value_heads": 4}, intermediate_size=48,
                                          moe_intermediate_size=24, num_hidden_layers=3, n_routed_experts=8,
                                          num_experts_per_tok=2, q_lora_rank=None, kv_lora_rank=24,
                                          qk_nope_head_dim=10, qk_rope_head_dim=6, v_head_dim=12,
                                          n_shared_experts=1, first_k_dense_replace=2),
        # q/k/v biases without an o_proj bias, per-head q/k norms, grouped sigmoid routing
        "glm4_moe": t.Glm4MoeConfig(**common, head_dim=20, intermediate_size=48, moe_intermediate_size=24,
                                    num_hidden_layers=3, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
                                    topk_group=1, n_shared_experts=1, first_k_dense_replace=1, attention_bias=True,
                                    use_qk_norm=True),
        # sinks, biases on q/k/v/o, the router and every expert; fused [E, H, 2I] experts on disk
        "gpt_oss": t.GptOssConfig(**common, intermediate_size=40, num_hidden_layers=2, head_dim=18,
                                  num_local_experts=6, num_experts_per_tok=2),
        # linear / full / linear (dense MLP) / full: gated DeltaNet weights, q_proj with its gate, a gated shared expert
        "qwen3_next": t.Qwen3NextConfig(**common, head_dim=24, intermediate_size=48, moe_intermediate_size=24,
                                        shared_expert_intermediate_size=40, num_hidden_layers=4, num_experts=8,
                                        num_experts_per_tok=2, mlp_only_layers=[2], full_attention_interval=2,
                                        linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=12,
                                        linear_value_head_dim=10),
    }


def _save(config, path: Path, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "deepseek_v2",
                                  "glm4_moe", "gpt_oss", "qwen3_next"])
def test_param_counts_match_transformers_and_headers_per_part(arch, tmp_path):
    model = _save(_tiny_configs()[arch], tmp_path)
    shape = ModelShape.from_dir(tmp_path)
    counts = params_by_part(shape)
    found = census(tmp_path)
    assert shape.arch == arch
    saved_buffers = set(model.state_dict()) & {n for n, _ in model.named_buffers()}  # e_score_correction_bias
    assert sum(counts.values()) == sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for n, b in model.named_buffers() if n in saved_buffers)
    assert found is not None and found.params["other"] == 0
    assert {p: found.params[p] for p in counts} == counts
    expert_sizes = {n: p.numel() for n, p in model.named_parameters() if "experts" in n and "shared" not in n}
    assert counts[ROUTED] == sum(expert_sizes.values())


def test_qwen3_30b_a3b_figures_from_config_numbers(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    p = build_plan(tmp_path, PlanOptions(experts_precision="int4", kv_tokens=1000), bandwidth_gbps=20.0)
    assert 30.4e9 < p.params_total < 30.6e9  # published: 30.5B total
    assert 3.3e9 < p.params_active < 3.4e9  # published: 3.3B activated
    assert p.kv_bytes_per_token == 2 * 48 * 4 * 128 * 2
    assert p.kv_bytes == 1000 * p.kv_bytes_per_token
    # int4 + one fp16 scale per 32 weights = 0.5625 bytes per expert weight
    assert p.experts_bytes == pytest.approx(p.params[ROUTED] * 0.5625, rel=1e-9)
    assert p.host_ram_bytes == p.experts_bytes and p.fast_device_bytes == p.dense_bytes + p.kv_bytes
    assert p.checkpoint_check == {"headers": False}
    assert p.checkpoint_disk_bytes == p.params_total * 2


DEEPSEEK_V3 = {  # numbers of deepseek-ai/DeepSeek-V3 config.json (its yarn rope_scaling left out: sizing ignores it)
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
    "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
    "norm_topk_prob": True, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "num_nextn_predict_layers": 1,
}


@pytest.mark.parametrize("model_type", ["deepseek_v3", "kimi_k2"])
def test_deepseek_v3_figures_and_latent_kv_from_config_numbers(tmp_path, model_type):
    (tmp_path / "config.json").write_text(json.dumps({**DEEPSEEK_V3, "model_type": model_type}))
    p = build_plan(tmp_path, PlanOptions(experts_precision="int4", kv_tokens=1000), bandwidth_gbps=20.0)
    assert 670.5e9 < p.params_total < 671.5e9  # published: 671B total (the MTP module's 14B not counted)
    assert 37.0e9 < p.params_active < 38.0e9  # published: 37B activated
    assert p.kv_bytes_per_token == 61 * (512 + 64) * 2  # the latent and the roped key, bf16: not 128 heads of K+V
    assert p.params["shared_experts"] == 58 * 3 * 7168 * 2048


GLM_45_AIR = {  # numbers of zai-org/GLM-4.5-Air config.json
    "model_type": "glm4_moe", "vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 10944,
    "moe_intermediate_size": 1408, "num_hidden_layers": 46, "num_attention_heads": 96, "num_key_value_heads": 8,
    "head_dim": 128, "n_shared_experts": 1, "n_routed_experts": 128, "num_experts_per_tok": 8,
    "first_k_dense_replace": 1, "norm_topk_prob": True, "attention_bias": True, "use_qk_norm": False,
    "partial_rotary_factor": 0.5, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "rope_theta": 1000000, "num_nextn_predict_layers": 1,
}


def test_glm_45_air_figures_from_config_numbers(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(GLM_45_AIR))
    p = build_plan(tmp_path, PlanOptions(experts_precision="int4", kv_tokens=1000), bandwidth_gbps=20.0)
    assert 106.0e9 < p.params_total < 107.5e9  # published: 106B total (the MTP layer not counted)
    embeddings = 2 * 151552 * 4096
    assert 12.0e9 < p.params_active - embeddings < 12.5e9  # published: 12B active, embeddings aside
    assert p.kv_bytes_per_token == 2 * 46 * 8 * 128 * 2


QWEN3_NEXT_80B_A3B = {  # numbers of Qwen/Qwen3-Next-80B-A3B-Instruct config.json
    "model_type": "qwen3_next", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5120,
    "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "num_experts": 512, "num_experts_per_tok": 10, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4, "full_attention_interval": 4, "partial_rotary_factor": 0.25, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}


def test_qwen3_next_80b_a3b_figures_from_config_numbers(tmp_path):
    """Qwen3-Next-80B-A3B: 80B total, 3B activated (published); KV only in its 12 full-attention layers, and a
    recurrent state per sequence in the 36 linear-attention ones."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_NEXT_80B_A3B))
    p = build_plan(tmp_path, PlanOptions(experts_precision="int4", kv_tokens=1000), bandwidth_gbps=20.0)
    assert 79.5e9 < p.params_total < 81.5e9
    assert 2.8e9 < p.params_active - p.params[EMBED] - p.params[LM_HEAD] < 3.3e9  # "A3B": the embeddings aside
    assert p.kv_bytes_per_token == 2 * 12 * 2 * 256 * 2
    conv = (2 * 16 * 128 + 32 * 128) * 3
    assert p.state_bytes == plan_mod.STATE_SLOTS * 36 * 4 * (conv + 32 * 128 * 128)
    assert p.fast_device_bytes == p.dense_bytes + p.kv_bytes + p.state_bytes


GPT_OSS_20B = {  # numbers of openai/gpt-oss-20b config.json
    "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
    "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
    "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128, "tie_word_embeddings": False,
    "attention_bias": True, "max_position_embeddings": 131072, "swiglu_limit": 7.0, "rope_theta": 150000,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096},
    "layer_types": ["sliding_attention", "full_attention"] * 12, "torch_dtype": "bfloat16",
}


@pytest.mark.parametrize(("layers", "experts", "total", "active"), [(24, 32, 20.91e9, 3.61e9),
                                                                    (36, 128, 116.83e9, 5.13e9)])
def test_gpt_oss_figures_from_config_numbers(tmp_path, layers, experts, total, active):
    """gpt-oss-20b and (with its layer and expert counts) gpt-oss-120b against OpenAI's published counts,
    whose active figure leaves out the embedding."""
    config = {**GPT_OSS_20B, "num_hidden_layers": layers, "num_local_experts": experts,
              "layer_types": ["sliding_attention", "full_attention"] * (layers // 2)}
    (tmp_path / "config.json").write_text(json.dumps(config))
    p = build_plan(tmp_path, PlanOptions(experts_precision="int4", kv_tokens=1000), bandwidth_gbps=20.0)
    assert p.params_total == pytest.approx(total, abs=0.01e9)
    assert p.params_active - p.params[EMBED] == pytest.approx(active, abs=0.01e9)
    assert p.kv_bytes_per_token == 2 * layers * 8 * 64 * 2  # every layer's K and V are cached in full
    biases = (2 * 2880 + 2880) * experts * layers * 4  # expert biases stay fp32 in the packed shards
    assert p.experts_bytes == pytest.approx((p.params[ROUTED] - biases // 4) * 0.5625 + biases, rel=1e-9)


@pytest.fixture(scope="module")
def qwen3_checkpoints(tmp_path_factory):
    """The random Qwen3-MoE of the brief (hidden 256, 4 layers, 16 experts) saved in fp32 and bf16."""
    cfg = transformers.Qwen3MoeConfig(vocab_size=8192, hidden_size=256, intermediate_size=512,
                                      moe_intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
                                      num_key_value_heads=2, num_experts=16, num_experts_per_tok=4)
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        out[name] = tmp_path_factory.mktemp(f"qwen3-{name}")
        _save(cfg, out[name], dtype)
    return out


_LOAD_AND_MEASURE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from safetensors.torch import load_file
    def rss_anon():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    before = rss_anon()
    tensors = {}
    for f in sorted(Path(sys.argv[1]).glob("*.safetensors")):
        tensors.update({k: v.clone() for k, v in load_file(f).items()})  # owned copies, not the mmap
    grown = rss_anon() - before
    print(json.dumps({"rss_growth": grown,
                      "tensor_bytes": sum(t.numel() * t.element_size() for t in tensors.values())}))
""")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_plan_bytes_match_a_real_load_within_10_percent(qwen3_checkpoints, precision):
    path = qwen3_checkpoints[precision]
    opts = PlanOptions(experts_precision=precision, dense_precision=precision, device="cpu", kv_tokens=0)
    p = build_plan(path, opts, bandwidth_gbps=10.0)
    out = subprocess.run([sys.executable, "-c", _LOAD_AND_MEASURE, str(path)], capture_output=True,
                         text=True, check=True, timeout=120)
    real = json.loads(out.stdout)
    predicted = sum(p.bytes.values())
    assert predicted == p.host_ram_bytes  # device cpu, no KV: RAM holds exactly the weights
    assert abs(predicted - real["tensor_bytes"]) <= 0.10 * real["tensor_bytes"]
    assert abs(predicted - real["rss_growth"]) <= 0.10 * real["rss_growth"]
    assert p.checkpoint_check["match"] is True
    assert abs(p.checkpoint_disk_bytes - predicted) <= 0.10 * predicted


@pytest.mark.parametrize("name", ["int4", "int8", "bf16", "fp32"])
def test_expert_bytes_equal_the_kernel_packing(name):
    """One expert (gate_up [2I, H], down [H, I]) as kernels.formats packs it, scales included."""
    from kernels import pack_experts

    g = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(1, 256, 256, generator=g), torch.randn(1, 256, 128, generator=g)  # I=128, H=256
    prec = PRECISIONS[name]
    assert prec.matrix_bytes(256, 256) + prec.matrix_bytes(256, 128) == pack_experts(
        gate_up, down, name, progress=False).nbytes


def _run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="moegate")
    plan_mod.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    code = args.func(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_json_ceiling_and_hot_experts(qwen3_checkpoints, capsys):
    path = str(qwen3_checkpoints["bf16"])
    code, out, _ = _run_cli(["plan", "--model", path, "--json", "--bandwidth", "12.5", "--device", "cuda",
                             "--hot-experts", "2", "--kv-tokens", "4096", "--experts-precision", "int8"], capsys)
    assert code == 0
    p = json.loads(out)
    assert p["options"]["experts_precision"] == "int8" and p["options"]["hot_experts"] == 2
    assert p["decode_ceiling_tok_s"] == pytest.approx(12.5e9 / p["streamed_bytes_per_token"])
    expert_params = 3 * 256 * 256
    assert p["hot_experts_bytes"] == 2 * 4 * expert_params * 2
    active = 4 * 4 * PRECISIONS["int8"].matrix_bytes(256, 256) * 3
    assert p["experts_ceiling_tok_s"] == pytest.approx(12.5e9 / active)
    assert p["fast_device_bytes"] == p["dense_bytes"] + p["hot_experts_bytes"] + p["kv_bytes"]
    assert p["kv_bytes"] == 4096 * 2 * 4 * 2 * 32 * 2  # layers * kv heads * head_dim(256/8) * bf16


def test_cli_text_output_measures_bandwidth(qwen3_checkpoints, capsys):
    code, out, _ = _run_cli(["plan", "--model", str(qwen3_checkpoints["fp32"]), "--device", "cpu"], capsys)
    assert code == 0
    assert "decode ceiling" in out and "routed_experts" in out and "match the config counts" in out
    gbps = float(out.split("host bandwidth ")[1].split(" GB/s")[0])
    assert 0.5 < gbps < 5000


def test_measure_bandwidth_is_quick_and_plausible():
    import time

    t = time.perf_counter()
    gbps = measure_bandwidth(total_mb=64, repeats=2)
    assert time.perf_counter() - t < 5
    assert 0.5 < gbps < 5000 and math.isfinite(gbps)


def test_headers_that_disagree_with_config_are_reported(qwen3_checkpoints, tmp_path, capsys):
    src = qwen3_checkpoints["bf16"]
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    cfg["num_experts"] = cfg.pop("num_local_experts", cfg.get("num_experts")) * 2
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    code, out, _ = _run_cli(["plan", "--model", str(tmp_path), "--bandwidth", "10", "--device", "cpu"], capsys)
    assert code == 0 and "DISAGREE" in out and "routed_experts" in out


@pytest.mark.parametrize("bad, message", [
    ({"model_type": "llama", "hidden_size": 8}, "unsupported model_type 'llama'"),
    ({"model_type": "mixtral", "hidden_size": 64}, "lacks num_attention_heads"),
])
def test_bad_configs_exit_2_with_a_message(tmp_path, capsys, bad, message):
    (tmp_path / "config.json").write_text(json.dumps(bad))
    code, _, err = _run_cli(["plan", "--model", str(tmp_path), "--bandwidth", "1"], capsys)
    assert code == 2 and message in err


def test_missing_dir_and_bad_options_are_typed_errors(tmp_path):
    with pytest.raises(SizingError, match="needs a checkpoint directory"):
        ModelShape.from_dir(tmp_path / "nope")
    with pytest.raises(SizingError, match="needs a GPU"):
        PlanOptions(device="cpu", hot_experts=2)
    with pytest.raises(SizingError, match="dense model"):
        ModelShape.from_hf({**QWEN3_30B_A3B, "mlp_only_layers": list(range(48))})


def test_both_modes_precision_and_streaming_load_peak(tmp_path, capsys):
    """A policy holding int4 for exploration and int8 (+ bf16 formatting layers) for execution pays for both."""
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    one = build_plan(tmp_path, PlanOptions(experts_precision="int4", kv_tokens=0), 20.0)
    both = build_plan(tmp_path, PlanOptions(experts_precision="int4", kv_tokens=0, execution_precision="int8",
                                            formatting_layers=4, formatting_precision="bf16"), 20.0)
    layer = {f: build_plan(tmp_path, PlanOptions(experts_precision=f, kv_tokens=0), 20.0).experts_bytes // 48
             for f in ("int4", "int8", "bf16")}
    assert one.experts_by_mode == {"exploration": 48 * layer["int4"], "execution": 48 * layer["int4"],
                                   "resident": 48 * layer["int4"]}
    assert both.experts_by_mode == {"exploration": 48 * layer["int4"],
                                    "execution": 44 * layer["int8"] + 4 * layer["bf16"],
                                    "resident": 48 * layer["int4"] + 44 * layer["int8"] + 4 * layer["bf16"]}
    assert both.host_ram_bytes == both.experts_by_mode["resident"]  # device cuda: RAM holds the experts
    # streamed load: resident host weights + a bounded working set, not the 57 GiB bf16 checkpoint
    for p in (one, both):
        assert p.load_peak_bytes == p.host_ram_bytes + p.load_working_bytes
        assert 0 < p.load_working_bytes < 2 * GIB
    cpu = build_plan(tmp_path, PlanOptions(experts_precision="int4", kv_tokens=0, device="cpu"), 20.0)
    assert cpu.load_peak_bytes == cpu.dense_bytes + cpu.experts_bytes + cpu.load_working_bytes
    code, out, _ = _run_cli(["plan", "--model", str(tmp_path), "--bandwidth", "20", "--execution-precision",
                             "int8", "--formatting-layers", "4"], capsys)
    assert code == 0
    assert "routed experts, execution (int8, last 4 MoE layers bf16)" in out
    assert f"{both.experts_by_mode['resident'] / GIB:8.2f} GiB" in out
    assert "RAM peak while loading (anonymous)" in out


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3", "gpt_oss", "qwen3_next"])
def test_gguf_directories_are_sized_from_their_tensor_index(arch, hf_checkpoint, tmp_path, capsys):
    """A llama.cpp directory (one file, or split shards): the same weights per part as the safetensors it was
    written from, its files' bytes on disk, and the config read from its metadata agreeing with both."""
    src = hf_checkpoint(arch, **({"mlp_only_layers": None} if arch == "qwen3_next" else {}))
    want = census(src)
    for shards in (1, 3):
        out = tmp_path / f"{arch}-{shards}"
        out.mkdir()
        write_gguf(src, out / "m.gguf", "Q8_0", shards=shards)
        files = sorted(out.glob("*.gguf"))
        assert len(files) == shards
        p = build_plan(out, PlanOptions(kv_tokens=64, device="cpu"), bandwidth_gbps=10.0)
        assert p.checkpoint_check["headers"] and p.checkpoint_check["source"] == "gguf"
        assert p.checkpoint_check["match"], p.checkpoint_check["mismatches"]
        assert p.checkpoint_disk_bytes == sum(f.stat().st_size for f in files)
        found = census(out)
        assert found.params == want.params
        assert found.bytes[ROUTED] < want.bytes[ROUTED]  # Q8_0 as stored: ~8.5 bits a weight against bf16/fp32
        code, text, _ = _run_cli(["plan", "--model", str(out), "--bandwidth", "10", "--device", "cpu"], capsys)
        assert code == 0 and "tensors in the GGUF tensor index match the config counts" in text
        assert "no safetensors" not in text
