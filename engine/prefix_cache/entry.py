"""Serialized block entry for the disk and redis tiers: magic, version, JSON header, payload; verified on read."""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass

import torch

from engine.prefix_cache.base import CorruptEntry

MAGIC = b"MGKV"
VERSION = 1
_PREFIX = struct.Struct("<4sHI")  # magic, version, header length

_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.int8)}


@dataclass(frozen=True)
class EntryCodec:
    """What every entry of this engine must match: fingerprint, shape [L, 2, block, KV, D], dtype."""

    fingerprint: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def payload_bytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.finfo(self.dtype).bits // 8 if self.dtype.is_floating_point else n

    def encode(self, key: str, kv: torch.Tensor) -> bytes:
        if tuple(kv.shape) != self.shape or kv.dtype != self.dtype:
            raise ValueError(f"entry {key}: got {tuple(kv.shape)} {kv.dtype}, expected {self.shape} {self.dtype}")
        payload = kv.contiguous().view(torch.uint8).numpy().tobytes()
        header = json.dumps({
            "key": key, "fingerprint": self.fingerprint, "shape": list(self.shape), "dtype": str(self.dtype),
            "sha256": hashlib.sha256(payload).hexdigest(),
        }).encode()
        return _PREFIX.pack(MAGIC, VERSION, len(header)) + header + payload

    def decode(self, key: str, data: bytes) -> torch.Tensor:
        if len(data) < _PREFIX.size:
            raise CorruptEntry(f"entry {key}: truncated ({len(data)} bytes)")
        magic, version, hlen = _PREFIX.unpack_from(data)
        if magic != MAGIC or version != VERSION:
            raise CorruptEntry(f"entry {key}: bad magic/version {magic!r}/{version}")
        try:
            header = json.loads(data[_PREFIX.size : _PREFIX.size + hlen])
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CorruptEntry(f"entry {key}: unreadable header ({exc})") from exc
        payload = data[_PREFIX.size + hlen :]
        expect = {"key": key, "fingerprint": self.fingerprint, "shape": list(self.shape), "dtype": str(self.dtype)}
        for field, value in expect.items():
            if header.get(field) != value:
                raise CorruptEntry(f"entry {key}: header {field}={header.get(field)!r}, expected {value!r}")
        if len(payload) != self.payload_bytes:
            raise CorruptEntry(f"entry {key}: payload {len(payload)} bytes, expected {self.payload_bytes}")
        if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
            raise CorruptEntry(f"entry {key}: payload checksum mismatch")
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(self.dtype).reshape(self.shape)
