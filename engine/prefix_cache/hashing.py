"""Block hash chain over token ids, rooted in a salt (tenant + request mode) and the engine's numerics fingerprint."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

from engine.identity import checkpoint_identity

_VERSION = b"moegate-kv-v1"


def default_disk_cache_dir() -> Path:
    """`MOEGATE_CACHE_DIR`/kv when set, else ~/.cache/moegate/kv (what `moegate serve` should pass)."""
    root = os.environ.get("MOEGATE_CACHE_DIR")
    return Path(root) / "kv" if root else Path.home() / ".cache" / "moegate" / "kv"


def model_fingerprint(model_dir: str | Path, dtype: str, numerics: str) -> str:
    """sha256 over the checkpoint's identity (engine/identity.py), the dtype and the numerics settings that change
    KV bits (KV dtype, block size, precision profile, deferral)."""
    h = hashlib.sha256(_VERSION)
    h.update(checkpoint_identity(model_dir).encode())
    h.update(json.dumps({"dtype": dtype, "numerics": numerics}, sort_keys=True).encode())
    return h.hexdigest()


class BlockHasher:
    """hash_i = sha256(hash_{i-1} || tokens of block i); hash_{-1} = sha256(version, fingerprint, salt).

    Only full blocks are hashed: a block's hash names its whole prefix, so equal hashes mean equal KV inputs.
    """

    def __init__(self, fingerprint: str, block_size: int) -> None:
        self.fingerprint = fingerprint
        self.block_size = block_size

    def root(self, salt: str) -> bytes:
        h = hashlib.sha256(_VERSION)
        for part in (self.fingerprint, salt):
            data = part.encode()
            h.update(struct.pack("<Q", len(data)) + data)  # length-prefixed: no ambiguity between parts
        return h.digest()

    def extend(self, hashes: list[str], root: bytes, token_ids: list[int], num_blocks: int) -> None:
        """Appends to `hashes` (hex) until it covers the first `num_blocks` full blocks of `token_ids`."""
        bs = self.block_size
        prev = bytes.fromhex(hashes[-1]) if hashes else root
        for i in range(len(hashes), num_blocks):
            block = token_ids[i * bs : (i + 1) * bs]
            if len(block) < bs:
                raise ValueError(f"block {i} is not full ({len(block)} of {bs} tokens)")
            prev = hashlib.sha256(prev + struct.pack(f"<{bs}q", *block)).digest()
            hashes.append(prev.hex())
