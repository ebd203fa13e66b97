"""engine/identity.py: one checkpoint identity, equal for copies, different for other weights of the same layout."""

from __future__ import annotations

import json
import shutil

from engine.identity import checkpoint_identity
from tests.engine.conftest import write_hf_checkpoint


def test_identity_follows_the_weights_not_the_path(hf_checkpoint, tmp_path):
    path = hf_checkpoint("qwen3_moe")
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    assert checkpoint_identity(path) == checkpoint_identity(copy)  # another machine's copy: the same identity
    other_seed = tmp_path / "seed1"
    write_hf_checkpoint(other_seed, "qwen3_moe", seed=1)  # same names, shapes and offsets; other weights
    assert checkpoint_identity(other_seed) != checkpoint_identity(path)
    assert checkpoint_identity(hf_checkpoint("qwen3_moe", num_hidden_layers=3)) != checkpoint_identity(path)
    config = copy / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "rms_norm_eps": 0.5}))
    assert checkpoint_identity(copy) != checkpoint_identity(path)
