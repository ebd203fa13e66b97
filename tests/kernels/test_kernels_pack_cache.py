"""Pack cache: a hit skips packing; stale, corrupt and mismatched entries are dropped and rebuilt."""

from __future__ import annotations

import os

import pytest
import torch
from kernel_cases import random_experts

from kernels import pack_cache
from kernels.pack_cache import PackCache, file_identity


def _same(a, b) -> bool:
    return a.expert_ids == b.expert_ids and all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)


def test_hit_skips_packing(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    w_gu, w_dn = random_experts(4, 64, 32)
    first = PackCache(tmp_path).get_or_pack("layer0.experts", w_gu, w_dn, "int4", 32, progress=False)

    def no_pack(*args, **kwargs):
        raise AssertionError("a cache hit must not repack")

    monkeypatch.setattr(pack_cache, "pack_experts", no_pack)
    cache = PackCache(tmp_path)
    second = cache.get_or_pack("layer0.experts", w_gu, w_dn, "int4", 32, progress=False)
    assert (cache.hits, cache.misses, cache.rejected) == (1, 0, 0)
    assert _same(first, second)
    assert not list(tmp_path.glob("*.tmp")), "atomic write left a temp file"


def test_key_covers_source_format_and_group(tmp_path) -> None:
    w_gu, w_dn = random_experts(2, 64, 32)
    cache = PackCache(tmp_path)
    cache.get_or_pack("l0", w_gu, w_dn, "int8", 32, progress=False)
    cache.get_or_pack("l0", w_gu, w_dn, "int8", 64, progress=False)
    cache.get_or_pack("l0", w_gu, w_dn, "int4", 32, progress=False)
    changed = w_gu.clone()
    changed[0, 0, 0] += 1.0
    cache.get_or_pack("l0", changed, w_dn, "int8", 32, progress=False)
    assert (cache.hits, cache.misses) == (0, 4)
    cache.get_or_pack("l0", w_gu, w_dn, "int8", 64, progress=False)
    assert cache.hits == 1
    renamed = cache.get_or_pack("l0", w_gu, w_dn, "int8", 64, progress=False, expert_ids=(5, 9))
    assert cache.misses == 5 and renamed.expert_ids == (5, 9)
    assert cache.get_or_pack("l0", w_gu, w_dn, "int8", 64, progress=False, expert_ids=(5, 9)).expert_ids == (5, 9)
    assert cache.hits == 2


def test_file_identity_source(tmp_path) -> None:
    ckpt = tmp_path / "model.safetensors"
    ckpt.write_bytes(b"x" * 10)
    w_gu, w_dn = random_experts(2, 64, 32)
    cache = PackCache(tmp_path / "cache")
    cache.get_or_pack("l0", w_gu, w_dn, "bf16", source=file_identity(ckpt), progress=False)
    cache.get_or_pack("l0", w_gu, w_dn, "bf16", source=file_identity(ckpt), progress=False)
    assert cache.hits == 1
    os.utime(ckpt, ns=(1, 1))  # a rewritten checkpoint (new mtime) is a different source
    cache.get_or_pack("l0", w_gu, w_dn, "bf16", source=file_identity(ckpt), progress=False)
    assert cache.misses == 2
    cache.get_or_pack("l0", w_gu[:1], w_dn[:1], "bf16", source=file_identity(ckpt), progress=False)
    assert cache.misses == 3  # same source string, different shapes: never served


def test_corrupt_entry_is_dropped_and_repacked(tmp_path) -> None:
    w_gu, w_dn = random_experts(3, 64, 32)
    good = PackCache(tmp_path).get_or_pack("l1", w_gu, w_dn, "int8", progress=False)
    (entry,) = tmp_path.glob("*.safetensors")
    data = bytearray(entry.read_bytes())
    data[-5] ^= 0xFF  # flip bits inside the tensor data
    entry.write_bytes(bytes(data))
    cache = PackCache(tmp_path)
    again = cache.get_or_pack("l1", w_gu, w_dn, "int8", progress=False)
    assert (cache.hits, cache.misses, cache.rejected) == (0, 1, 1)
    assert _same(good, again)
    entry.write_bytes(b"garbage")  # unparseable file
    cache.get_or_pack("l1", w_gu, w_dn, "int8", progress=False)
    assert cache.rejected == 2
    assert PackCache(tmp_path).get_or_pack("l1", w_gu, w_dn, "int8", progress=False) is not None


def test_stale_entry_under_the_expected_name_is_rejected(tmp_path) -> None:
    """A file whose stored key differs (e.g. an older layout version) is never served."""
    w_gu, w_dn = random_experts(2, 64, 32)
    cache = PackCache(tmp_path)
    packed = cache.get_or_pack("l2", w_gu, w_dn, "int4", progress=False)
    old_key = cache.key("l2", "src", "int4", None).replace("layout", "layout0-")
    new_key = cache.key("l2", "src", "int4", None)
    cache.store(old_key, "l2", packed).rename(cache.path_for(new_key, "l2"))
    assert cache.load(new_key, "l2") is None
    assert cache.rejected == 1 and not cache.path_for(new_key, "l2").exists()
