"""Split GGUF files (llama.cpp's gguf-split layout): the shards load as one checkpoint, equal to the single
file and to transformers; a missing or foreign shard is one error naming it."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import ModelConfig
from engine.errors import CheckpointError, UnsupportedCheckpointError
from engine.gguf import find_gguf
from engine.gguf_file import open_gguf
from engine.llm_engine import LLM
from engine.sampling_params import SamplingParams
from modeltools.gguf_write import write_gguf

STEPS = 12


def _greedy(model, prompt):
    llm = LLM(model, num_kv_blocks=32, block_size=8, progress=False)
    return llm.generate([prompt], SamplingParams(max_tokens=STEPS, ignore_eos=True))[0].token_ids


def test_split_gguf_is_the_single_file(hf_checkpoint, tmp_path):
    src = hf_checkpoint("qwen3_moe")
    (tmp_path / "one").mkdir()
    (tmp_path / "split").mkdir()
    single = write_gguf(src, tmp_path / "one" / "model.gguf", "Q8_0")
    first = write_gguf(src, tmp_path / "split" / "model.gguf", "Q8_0", shards=3)
    names = sorted(p.name for p in (tmp_path / "split").iterdir())
    assert names == [f"model-0000{i}-of-00003.gguf" for i in (1, 2, 3)] and first.name == names[0]
    shards = [open_gguf(first).shards[i].meta for i in range(3)]
    assert [(m["split.no"], m["split.count"]) for m in shards] == [(0, 3), (1, 3), (2, 3)]
    assert "general.architecture" in shards[0] and "general.architecture" not in shards[1]  # metadata in the first
    one, split = open_gguf(single), open_gguf(first)
    assert split.tensors.keys() == one.tensors.keys() and shards[0]["split.tensors.count"] == len(one.tensors)
    assert all(len(s.tensors) < len(one.tensors) for s in split.shards)
    for name in one.tensors:
        assert (split.raw(name) == one.raw(name)).all(), name
    # the directory, the first shard and a later shard all name the same model
    assert find_gguf(tmp_path / "split") == find_gguf(tmp_path / "split" / names[2]) == tmp_path / "split" / names[0]
    assert ModelConfig.from_dir(tmp_path / "split") == ModelConfig.from_dir(tmp_path / "one")

    prompt = torch.randint(1, 511, (11,), generator=torch.Generator().manual_seed(5)).tolist()
    expected = _greedy(tmp_path / "one", prompt)
    assert _greedy(tmp_path / "split", prompt) == expected
    assert _greedy(first, prompt) == expected


def test_split_f32_gguf_matches_transformers(hf_checkpoint, tmp_path):
    src = hf_checkpoint("qwen2_moe")
    (tmp_path / "split").mkdir()
    write_gguf(src, tmp_path / "split" / "m.gguf", "F32", shards=2)
    prompt = torch.randint(1, 511, (9,), generator=torch.Generator().manual_seed(7)).tolist()
    ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    out = ref.generate(torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert _greedy(tmp_path / "split", prompt) == out[0, len(prompt):].tolist()


def test_broken_split_gguf(hf_checkpoint, tmp_path):
    src = hf_checkpoint("qwen3_moe")
    good, other = tmp_path / "good", tmp_path / "other"
    good.mkdir()
    other.mkdir()
    write_gguf(src, good / "m.gguf", "F32", shards=3)
    write_gguf(src, other / "m.gguf", "F32", shards=2)

    def broken(name, change):
        shutil.copytree(good, tmp_path / name)
        change(tmp_path / name)
        return tmp_path / name

    missing = broken("missing", lambda d: (d / "m-00002-of-00003.gguf").unlink())
    with pytest.raises(CheckpointError, match=r"shard m-00002-of-00003\.gguf \(2 of 3\) is missing"):
        ModelConfig.from_dir(missing)
    first = broken("first", lambda d: (d / "m-00001-of-00003.gguf").unlink())
    for given in (first, first / "m-00003-of-00003.gguf"):
        with pytest.raises(CheckpointError, match=r"shard m-00001-of-00003\.gguf \(1 of 3\) is missing"):
            ModelConfig.from_dir(given)
    # a shard of another conversion under the expected name: its split.no / split.count disagree
    foreign = broken("foreign", lambda d: shutil.copy(other / "m-00002-of-00002.gguf", d / "m-00003-of-00003.gguf"))
    with pytest.raises(CheckpointError, match=r"m-00003-of-00003\.gguf is split\.no=1 of split\.count=2"):
        ModelConfig.from_dir(foreign)
    swapped = broken("swapped", lambda d: shutil.copy(d / "m-00002-of-00003.gguf", d / "m-00003-of-00003.gguf"))
    with pytest.raises(CheckpointError, match=r"m-00003-of-00003\.gguf is split\.no=1 of split\.count=3"):
        ModelConfig.from_dir(swapped)
    shutil.copy(other / "m-00001-of-00002.gguf", good / "m-00001-of-00002.gguf")  # two split models in one dir
    with pytest.raises(UnsupportedCheckpointError, match="4 .gguf files"):
        find_gguf(good)


def test_identity_covers_every_shard(hf_checkpoint, tmp_path):
    """The prefix cache and system_fingerprint key on the checkpoint identity: a later shard's bytes name it too."""
    from engine.identity import checkpoint_identity

    (tmp_path / "split").mkdir()
    first = write_gguf(hf_checkpoint("qwen3_moe"), tmp_path / "split" / "model.gguf", "Q8_0", shards=3)
    before = checkpoint_identity(first.parent)
    assert checkpoint_identity(first) == before  # the directory or its first shard: one checkpoint
    last = sorted(first.parent.glob("*.gguf"))[-1]
    data = bytearray(last.read_bytes())
    data[-1] ^= 0xFF  # a weight byte near the end of the last shard (within its head on these small files)
    last.write_bytes(bytes(data))
    assert checkpoint_identity(first.parent) != before
