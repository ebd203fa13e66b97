"""GPT-OSS checkpoints with MXFP4 experts (`*_blocks` / `*_scales`, quantization_config mxfp4), as released.

The checkpoint is converted here from a tiny random GPT-OSS (engine.mxfp4.quantize_mxfp4). The reference is
transformers on the same checkpoint with the experts written back dequantized (transformers' own MXFP4
loader needs `accelerate`); the dequantization itself is compared with transformers' decoder bit for bit.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine.errors import MissingTensorError, TensorShapeError
from engine.experts import PlacementConfig
from engine.llm_engine import LLM
from engine.loader import load_model
from engine.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from engine.sampling_params import SamplingParams

EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


@pytest.fixture(scope="module")
def mxfp4_pair(hf_checkpoint, tmp_path_factory):
    """(MXFP4 checkpoint, the same weights with dequantized experts in GPT-OSS's float layout)."""
    src = hf_checkpoint("gpt_oss", intermediate_size=96)  # MXFP4 blocks of 32 along hidden 64 and width 96
    root = tmp_path_factory.mktemp("mxfp4")
    mx, plain = root / "mx", root / "plain"
    shutil.copytree(src, mx)
    shutil.copytree(src, plain)
    state = load_file(src / "model.safetensors")
    packed, dequantized = dict(state), dict(state)
    for name in [n for n in state if n.endswith(EXPERTS)]:
        blocks, scales = quantize_mxfp4(state[name].transpose(1, 2))  # [E, N, K] rows: blocks along K
        del packed[name]
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
        dequantized[name] = dequantize_mxfp4(blocks, scales).transpose(1, 2).contiguous()
    save_file(packed, mx / "model.safetensors", metadata={"format": "pt"})
    save_file(dequantized, plain / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((mx / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (mx / "config.json").write_text(json.dumps(config))
    return mx, plain, state, dequantized


def test_dequantization_equals_transformers_decoder(mxfp4_pair):
    from transformers.integrations.mxfp4 import _convert_moe_packed_tensors

    mx, _, original, dequantized = mxfp4_pair
    packed = load_file(mx / "model.safetensors")
    name = "model.layers.1.mlp.experts.gate_up_proj"
    want = _convert_moe_packed_tensors(packed[name + "_blocks"], packed[name + "_scales"], dtype=torch.float32)
    assert torch.equal(dequantized[name], want)
    err = (want - original[name]).abs().amax().item()
    assert 0 < err <= original[name].abs().amax().item() / 4  # a real 4-bit rounding, half a step at most


@pytest.mark.parametrize("placement", [None, PlacementConfig(fast_format="fp32", exact_format="fp32"),
                                       PlacementConfig(fast_format="int8", exact_format="int8")])
def test_mxfp4_experts_generate_as_transformers_on_the_dequantized_weights(mxfp4_pair, placement):
    mx, plain, _, _ = mxfp4_pair
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, 500, (n,), generator=g).tolist() for n in (19, 26)]
    ref = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    want = [ref.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                         pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    llm = LLM(mx, num_kv_blocks=32, block_size=8, progress=False, placement=placement)
    got = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))]
    if placement is None or placement.fast_format == "fp32":
        assert got == want
    else:  # int8 requantizes the dequantized MXFP4 experts: the first tokens agree, drift stays small
        assert sum(a == b for g_, w_ in zip(got, want, strict=True) for a, b in zip(g_, w_, strict=True)) >= 15


def test_bad_mxfp4_tensors_are_typed_errors(mxfp4_pair, tmp_path):
    mx, _, _, _ = mxfp4_pair
    state = load_file(mx / "model.safetensors")
    name = "model.layers.2.mlp.experts.down_proj"
    for case, edit in (("missing", lambda s: s.pop(name + "_scales")),
                       ("shape", lambda s: s.update({name + "_blocks": s[name + "_blocks"][..., :8].contiguous()}))):
        bad = tmp_path / case
        shutil.copytree(mx, bad)
        edited = dict(state)
        edit(edited)
        save_file(edited, bad / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(MissingTensorError if case == "missing" else TensorShapeError, match="down_proj"):
            load_model(bad, progress=False)


def test_plan_reads_mxfp4_headers_as_the_weights_they_hold(mxfp4_pair):
    from modeltools.plan import PlanOptions, build_plan

    mx, plain, _, _ = mxfp4_pair
    plans = [build_plan(d, PlanOptions(experts_precision="int4", kv_tokens=100), bandwidth_gbps=20.0)
             for d in (mx, plain)]
    assert plans[0].checkpoint_check["match"] and plans[0].checkpoint_check["params_checkpoint"] == \
        plans[1].checkpoint_check["params_checkpoint"] == plans[0].params_total
    assert plans[0].checkpoint_disk_bytes < plans[1].checkpoint_disk_bytes
