"""RoPE scaling (engine/rope.py) against transformers' modeling_rope_utils, and long prompts end to end."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.config import ModelConfig
from engine.errors import CheckpointError
from engine.llm_engine import LLM
from engine.rope import RopeScaling, RotaryEmbedding, inv_freq
from engine.sampling_params import SamplingParams

VOCAB = 512  # the tiny checkpoints of tests/engine/conftest.py
HEAD_DIM, ORIGINAL, THETA = 16, 64, 10_000.0
LONG = [0.9 + 0.3 * i for i in range(HEAD_DIM // 2)]
SHORT = [1.0 + 0.05 * i for i in range(HEAD_DIM // 2)]
ROPES = {
    "linear": {"rope_type": "linear", "factor": 2.5},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "yarn_mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                    "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 16, "beta_slow": 2},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL},
    "longrope": {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG,
                 "original_max_position_embeddings": ORIGINAL},
}


def _hf_config(rope: dict, max_pos: int) -> dict:
    return dict(rope_parameters={**rope, "rope_theta": THETA}, max_position_embeddings=max_pos)


@pytest.mark.parametrize("name", ROPES)
@pytest.mark.parametrize("seq_len", [None, 40, 300])
def test_frequencies_match_transformers(name, seq_len):
    hf = _hf_config(ROPES[name], 4 * ORIGINAL if name != "dynamic" else ORIGINAL)
    config = Qwen3MoeConfig(hidden_size=64, num_attention_heads=4, head_dim=HEAD_DIM, **hf)
    ref, ref_attention = ROPE_INIT_FUNCTIONS[ROPES[name]["rope_type"]](config, "cpu", seq_len=seq_len)
    ours, attention = inv_freq(HEAD_DIM, THETA, RopeScaling.from_hf(hf), seq_len)
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)
    assert attention == pytest.approx(float(ref_attention), rel=1e-12)


def test_legacy_rope_scaling_key_and_errors():
    qwen3 = {"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
             "max_position_embeddings": 131072}
    s = RopeScaling.from_hf(qwen3)
    assert (s.rope_type, s.factor, s.original_max_position_embeddings) == ("yarn", 4.0, 32768)
    assert RopeScaling.from_hf({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}) is None
    with pytest.raises(CheckpointError, match="'ntk-by-parts'"):
        RopeScaling.from_hf({"rope_scaling": {"rope_type": "ntk-by-parts", "factor": 2}})
    with pytest.raises(CheckpointError, match="original_max_position_embeddings"):
        RopeScaling.from_hf({"rope_scaling": {"rope_type": "yarn", "factor": 2}})


@pytest.fixture(scope="module")
def long_prompt() -> list[int]:  # past ORIGINAL (and past max_position_embeddings for dynamic NTK)
    return torch.randint(1, VOCAB - 1, (150,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.mark.parametrize("name", ["yarn", "dynamic", "linear", "llama3", "longrope"])
def test_long_prompt_greedy_matches_transformers(tmp_path, write_checkpoint, name, long_prompt):
    max_pos = ORIGINAL if name == "dynamic" else 4 * ORIGINAL  # dynamic NTK grows past max_position_embeddings
    write_checkpoint(tmp_path, "qwen3_moe", seed=7, **_hf_config(ROPES[name], max_pos))
    assert ModelConfig.from_dir(tmp_path).rope_scaling.rope_type == ROPES[name]["rope_type"]
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    steps = 12
    expected = ref.generate(torch.tensor([long_prompt]), max_new_tokens=steps, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, len(long_prompt):].tolist()
    llm = LLM(tmp_path, num_kv_blocks=32, block_size=8, progress=False)
    params = SamplingParams(max_tokens=steps, ignore_eos=True)
    # alone, then beside a short prompt (per-sequence scaling must not depend on the batch)
    assert llm.generate([long_prompt], params)[0].token_ids == expected
    outs = llm.generate([long_prompt, long_prompt[:9]], params)
    assert outs[0].token_ids == expected


@pytest.mark.parametrize("head_dim", [16, 64, 80, 128])
@pytest.mark.parametrize("name", [None, "linear", "yarn", "llama3"])
def test_position_table_rows_equal_the_direct_expression(head_dim, name):
    """On the CPU the (cos, sin) rows come from a table of positions (grown by doubling): each row has the bits
    the direct expression gives for that position alone (a decode step) and inside a chunk (prefill)."""
    scaling = None if name is None else RopeScaling.from_hf(_hf_config(ROPES[name], 4 * ORIGINAL))
    rotary = RotaryEmbedding(head_dim, THETA, scaling)
    freqs = rotary._inv_freq(torch.device("cpu"), None)
    for positions in ([0], [255], [256], [1000], list(range(200, 300)), [3, 700, 5]):
        pos = torch.tensor(positions)
        for dtype in (torch.float32, torch.bfloat16):
            cos, sin = rotary(pos, dtype, [(len(positions), max(positions) + 1)])
            want = [RotaryEmbedding._direct(torch.tensor([p]), freqs, dtype) for p in positions]
            assert torch.equal(cos, torch.cat([c for c, _ in want])) and torch.equal(sin, torch.cat([s for _, s in want]))
            chunk = RotaryEmbedding._direct(pos, freqs, dtype)
            assert torch.equal(cos, chunk[0]) and torch.equal(sin, chunk[1])
    assert rotary._tables[torch.float32][0].shape[0] >= 1001
