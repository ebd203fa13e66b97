"""A broken checkpoint fails with an error that names the problem."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import (
    CheckpointError,
    MissingTensorError,
    TensorShapeError,
    UnexpectedTensorError,
    UnsupportedArchitectureError,
    UnsupportedCheckpointError,
)
from engine.loader import load_model


@pytest.fixture
def ckpt(hf_checkpoint, tmp_path):
    src = hf_checkpoint("qwen3_moe")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def test_missing_tensor_is_named(ckpt):
    tensors = load_file(str(ckpt / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    del tensors["model.layers.0.self_attn.q_norm.weight"]
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(MissingTensorError) as err:
        load_model(ckpt, progress=False)
    assert "model.layers.1.mlp.experts.5.up_proj.weight" in str(err.value)
    assert "model.layers.0.self_attn.q_norm.weight" in str(err.value)


def test_wrong_shape_is_named(ckpt):
    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors["model.layers.0.mlp.gate.weight"] = torch.zeros(7, 64)
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(TensorShapeError, match=r"model\.layers\.0\.mlp\.gate\.weight.*\[7, 64\].*\[8, 64\]"):
        load_model(ckpt, progress=False)


def test_unknown_architecture(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "llama"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="'llama'.*qwen3_moe"):
        load_model(ckpt, progress=False)


@pytest.mark.parametrize("damage", ["truncate", "garble_header"])
def test_corrupt_safetensors(ckpt, damage):
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    else:
        path.write_bytes(data[:8] + b"{not json" + data[17:])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(ckpt, progress=False)


def test_missing_config(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(tmp_path, progress=False)


def test_unexpected_tensor_is_an_error(ckpt):
    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors["model.layers.0.self_attn.extra_proj.weight"] = torch.zeros(4, 64)
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(UnexpectedTensorError, match=r"model\.layers\.0\.self_attn\.extra_proj\.weight"):
        load_model(ckpt, progress=False)


def test_quantization_tensors_without_config_are_named(ckpt):
    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"] = torch.ones(1, 1)
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(UnexpectedTensorError, match=r"q_proj\.weight_scale_inv.*quantization"):
        load_model(ckpt, progress=False)


def test_known_unused_tensors_load(ckpt, hf_checkpoint):
    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    tensors["model.layers.2.mlp.gate.weight"] = torch.zeros(8, 64)  # an MTP layer past num_hidden_layers=2
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(UnexpectedTensorError, match=r"model\.layers\.2\.mlp\.gate\.weight"):
        load_model(ckpt, progress=False)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (ckpt / "config.json").write_text(json.dumps(cfg))
    model = load_model(ckpt, progress=False)
    ref = load_model(hf_checkpoint("qwen3_moe"), progress=False)
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("method", ["gptq", "awq", "bitsandbytes", "compressed-tensors"])
def test_unsupported_quantization_is_named(ckpt, method):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": method, "bits": 4}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedCheckpointError, match=f"quant_method='{method}'"):
        load_model(ckpt, progress=False)
