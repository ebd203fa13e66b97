"""Prefix cache parts: salted hash chain, fingerprint, entry codec, RAM and disk tiers (LRU, corruption, restart)."""

from __future__ import annotations

import pytest
import torch

from engine.prefix_cache import BlockHasher, CorruptEntry, model_fingerprint
from engine.prefix_cache.disk import DiskTier
from engine.prefix_cache.entry import EntryCodec
from engine.prefix_cache.ram import RamTier
from engine.prefix_cache.writer import BackgroundWriter

SHAPE = (2, 2, 4, 2, 8)  # [L, 2, block, KV, D]


def _kv(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def _codec(fp: str = "f" * 64) -> EntryCodec:
    return EntryCodec(fp, SHAPE, torch.float32)


def test_hash_chain_names_the_whole_prefix_and_the_salt():
    h = BlockHasher("fp", block_size=4)
    toks = list(range(10))
    a: list[str] = []
    h.extend(a, h.root("tenant-a"), toks, 2)
    assert len(a) == 2 and len(set(a)) == 2
    b: list[str] = []
    h.extend(b, h.root("tenant-b"), toks, 2)
    assert not set(a) & set(b)  # another tenant never names the same block
    c: list[str] = []
    h.extend(c, h.root("tenant-a"), [99] + toks[1:], 2)
    assert c[0] != a[0] and c[1] != a[1]  # a change in block 0 changes every later hash
    d: list[str] = []
    h.extend(d, h.root("tenant-a"), toks[:4] + [7, 7, 7, 7], 2)
    assert d[0] == a[0] and d[1] != a[1]
    assert BlockHasher("other-fp", 4).root("tenant-a") != h.root("tenant-a")
    assert h.root("ab") != h.root("a\x00b")
    with pytest.raises(ValueError, match="not full"):
        h.extend(a, h.root("tenant-a"), toks, 3)  # only full blocks are hashed


def test_fingerprint_covers_weights_dtype_and_numerics(hf_checkpoint, tmp_path):
    path = hf_checkpoint("qwen3_moe")
    base = model_fingerprint(path, "float32", "defer=0")
    assert base == model_fingerprint(path, "float32", "defer=0")
    assert base != model_fingerprint(path, "bfloat16", "defer=0")
    assert base != model_fingerprint(path, "float32", "defer=1")
    assert base != model_fingerprint(hf_checkpoint("qwen3_moe", num_hidden_layers=3), "float32", "defer=0")


def test_codec_round_trips_and_rejects_every_kind_of_damage():
    codec, kv = _codec(), _kv(0)
    data = codec.encode("k1", kv)
    assert torch.equal(codec.decode("k1", data), kv)
    flipped = bytearray(data)
    flipped[-5] ^= 0x10
    damaged = {
        "checksum": bytes(flipped),
        "truncated": data[:-7],
        "empty": b"",
        "magic": b"XXXX" + data[4:],
    }
    for bad in damaged.values():
        with pytest.raises(CorruptEntry):
            codec.decode("k1", bad)
    with pytest.raises(CorruptEntry, match="key"):
        codec.decode("k2", data)  # an entry stored under another name
    with pytest.raises(CorruptEntry, match="fingerprint"):
        _codec("0" * 64).decode("k1", data)  # KV of another model or mode


def test_ram_tier_is_lru_within_its_byte_budget():
    one = _kv(0).numel() * 4
    ram = RamTier(capacity_bytes=3 * one)
    for i in range(3):
        assert ram.put(f"k{i}", _kv(i)) == []
    assert ram.get("k0") is not None  # k0 becomes most recent
    evicted = ram.put("k3", _kv(3))
    assert [k for k, _ in evicted] == ["k1"]
    assert ram.stats.bytes == 3 * one <= ram.capacity and ram.stats.evictions == 1
    assert "k1" not in ram and "k0" in ram


def test_disk_tier_survives_restart_and_stays_within_size(tmp_path):
    codec = _codec()
    entry = len(codec.encode("x" * 64, _kv(0)))
    disk = DiskTier(tmp_path, capacity_bytes=3 * entry, codec=codec)
    keys = [f"{i:064x}" for i in range(5)]
    for i, k in enumerate(keys):
        disk.put(k, _kv(i))
        on_disk = sum(p.stat().st_size for p in tmp_path.rglob("*.kv"))
        assert disk.stats.bytes == on_disk <= 3 * entry
    assert disk.stats.evictions == 2 and keys[0] not in disk
    reopened = DiskTier(tmp_path, capacity_bytes=3 * entry, codec=codec)  # a new process
    assert reopened.stats.entries == 3
    assert torch.equal(reopened.get(keys[4]), _kv(4))
    assert reopened.get(keys[0]) is None
    smaller = DiskTier(tmp_path, capacity_bytes=entry, codec=codec)  # a smaller budget after restart
    assert smaller.stats.entries == 1 and smaller.stats.bytes <= entry
    assert DiskTier(tmp_path, 10 * entry, _codec("0" * 64)).stats.entries == 0  # other fingerprint: other folder


def test_disk_tier_drops_corrupt_and_truncated_entries(tmp_path):
    disk = DiskTier(tmp_path, capacity_bytes=2**20, codec=_codec())
    keys = [f"{i:064x}" for i in range(3)]
    for i, k in enumerate(keys):
        disk.put(k, _kv(i))
    p0, p1 = (disk.root / k[:2] / f"{k}.kv" for k in keys[:2])
    raw = bytearray(p0.read_bytes())
    raw[-1] ^= 0xFF
    p0.write_bytes(bytes(raw))
    p1.write_bytes(p1.read_bytes()[:100])
    (disk.root / "00" / ".interrupted.tmp").write_bytes(b"partial")  # a crash mid-write
    assert disk.get(keys[0]) is None and disk.get(keys[1]) is None
    assert disk.stats.corrupt == 2 and not p0.exists() and not p1.exists()
    assert torch.equal(disk.get(keys[2]), _kv(2))
    DiskTier(tmp_path, capacity_bytes=2**20, codec=_codec())
    assert not list(tmp_path.rglob("*.tmp"))


def test_background_writer_writes_off_thread_and_flushes(tmp_path):
    disk = DiskTier(tmp_path, capacity_bytes=2**20, codec=_codec())
    writer = BackgroundWriter()
    for i in range(4):
        writer.submit(disk, f"{i:064x}", _kv(i))
    writer.flush()
    assert disk.stats.writes == 4 and torch.equal(disk.get(f"{3:064x}"), _kv(3))
    assert writer.pending_bytes == 0 and writer.dropped == 0
    writer.close()
    small = BackgroundWriter(max_pending_bytes=_kv(0).numel() * 4 - 1)  # nothing fits: dropped, never blocks
    small.submit(disk, f"{9:064x}", _kv(9))
    small.flush()
    assert small.dropped == 1 and f"{9:064x}" not in disk
    small.close()
