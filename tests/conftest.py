"""Shared fixtures: tiny random MoE checkpoints (one per arch and option set, cached for the session)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

# The tiny shape every engine test can afford: runs a forward in milliseconds.
TINY_SIZES = dict(hidden_size=64, num_layers=2, num_experts=8, top_k=2, moe_intermediate_size=32,
                  num_heads=4, num_kv_heads=2, vocab="bpe", dtype="float32", seed=0)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory `tiny_checkpoint(arch="qwen3_moe", **overrides) -> Path` of a written HF-style checkpoint.

    `overrides` replace TINY_SIZES entries or add arch options (norm_topk_prob, mlp_only_layers, ...).
    The same arguments return the same directory; treat it as read-only.
    """
    from modeltools.random_checkpoint import write_random_checkpoint

    cache: dict[tuple, Path] = {}

    def make(arch: str = "qwen3_moe", **overrides: object) -> Path:
        key = (arch, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"ckpt-{arch}")
            cache[key] = write_random_checkpoint(out, arch, **{**TINY_SIZES, **overrides})
        return cache[key]

    return make


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server on a free loopback port (skips without the binary); killed afterwards."""
    from tests.gateway.redis_process import RedisProcess

    server = RedisProcess(tmp_path)
    server.start()
    yield server
    server.kill()

