"""Block-FP8 checkpoints (DeepSeek-V3's weight_scale_inv format): dequantized on load, equal to transformers
on the dequantized checkpoint."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine.errors import CheckpointError, TensorShapeError, UnexpectedTensorError, UnsupportedCheckpointError
from engine.fp8 import SCALE_SUFFIX, BlockFp8
from engine.llm_engine import LLM
from engine.loader import load_model
from engine.sampling_params import SamplingParams
from modeltools.fp8_write import quantize_checkpoint


def _reference_dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    out = torch.empty(q.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            out[rows, cols] = q[rows, cols].float() * scale[i, j]
    return out


@pytest.mark.parametrize("block", [(128, 128), (16, 8), (7, 5)])
def test_quantize_dequantize(block):
    w = torch.randn(45, 70, generator=torch.Generator().manual_seed(0))
    fmt = BlockFp8(block)
    q, scale = fmt.quantize(w)
    assert q.dtype == torch.float8_e4m3fn
    assert scale.shape == (math.ceil(45 / block[0]), math.ceil(70 / block[1])) == fmt.scale_shape(w.shape)
    back = fmt.dequantize(q, scale)
    assert torch.equal(back, _reference_dequantize(q, scale, block))
    assert ((back - w).abs() / w.abs().clamp(min=0.05)).max() < 0.07  # e4m3 keeps 3 mantissa bits


def _dequantized_copy(src, dst, block):
    """The checkpoint transformers runs: every fp8 weight times its block scales, in fp32."""
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    del cfg["quantization_config"]
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(src / "model.safetensors"))
    out = {n: _reference_dequantize(t, tensors[n + SCALE_SUFFIX], block) if n + SCALE_SUFFIX in tensors else t
           for n, t in tensors.items() if not n.endswith(SCALE_SUFFIX)}
    save_file(out, str(dst / "model.safetensors"))
    return dst


@pytest.fixture(scope="module", params=[(128, 128), (16, 24)], ids=["block128", "block16x24"])
def fp8_pair(request, tmp_path_factory, write_checkpoint):
    root = tmp_path_factory.mktemp("fp8")
    write_checkpoint(root / "src", "qwen3_moe", seed=2, moe_intermediate_size=40)  # odd: 40 rows in 16-row blocks
    fp8 = quantize_checkpoint(root / "src", root / "fp8", request.param)
    return fp8, _dequantized_copy(fp8, root / "deq", request.param)


def test_checkpoint_is_fp8_on_disk(fp8_pair):
    fp8, _ = fp8_pair
    with safe_open(str(fp8 / "model.safetensors"), "pt") as f:
        assert f.get_slice("model.layers.1.mlp.experts.3.down_proj.weight").get_dtype() == "F8_E4M3"
        assert f.get_slice("model.layers.0.self_attn.q_proj.weight_scale_inv").get_dtype() == "F32"


def test_loaded_weights_are_the_dequantized_values(fp8_pair):
    fp8, deq = fp8_pair
    ours, ref = load_model(fp8, progress=False), load_model(deq, progress=False)
    for (name, p), (ref_name, q) in zip(ours.named_parameters(), ref.named_parameters(), strict=True):
        assert name == ref_name and torch.equal(p, q), name


def test_greedy_matches_transformers_on_dequantized(fp8_pair):
    fp8, deq = fp8_pair
    prompt = torch.randint(1, 511, (11,), generator=torch.Generator().manual_seed(4)).tolist()
    ref = AutoModelForCausalLM.from_pretrained(deq, dtype=torch.float32).eval()
    expected = ref.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(prompt):].tolist()
    llm = LLM(fp8, num_kv_blocks=16, block_size=8, progress=False)  # experts streamed into packed shards
    assert llm.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids == expected


def _rewrite(path, change):
    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def test_broken_fp8_checkpoints(fp8_pair, tmp_path):
    import shutil

    fp8, _ = fp8_pair
    name = "model.layers.0.self_attn.o_proj.weight"
    cases = [
        (lambda t: t.pop(name + SCALE_SUFFIX), CheckpointError, f"without a {SCALE_SUFFIX}.*o_proj"),
        (lambda t: t.__setitem__(name + SCALE_SUFFIX, torch.ones(9, 9)), TensorShapeError, "o_proj.weight_scale_inv"),
        (lambda t: t.__setitem__("model.layers.0.self_attn.extra.weight_scale_inv", torch.ones(1, 1)),
         UnexpectedTensorError, r"extra\.weight_scale_inv"),
    ]
    for i, (change, error, match) in enumerate(cases):
        broken = tmp_path / str(i)
        shutil.copytree(fp8, broken)
        _rewrite(broken, change)
        with pytest.raises(error, match=match):
            load_model(broken, progress=False)


@pytest.mark.parametrize("qc, match", [
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "e5m2"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "static"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size"),
])
def test_unsupported_fp8_variants(fp8_pair, tmp_path, qc, match):
    import shutil

    broken = shutil.copytree(fp8_pair[0], tmp_path / "ckpt")
    cfg = json.loads((broken / "config.json").read_text())
    cfg["quantization_config"] = qc
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedCheckpointError, match=match):
        load_model(broken, progress=False)
