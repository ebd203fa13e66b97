"""The one identity of a checkpoint: a digest of what names its weights, equal on every machine holding a copy.

The numerics fingerprint (`system_fingerprint`), the prefix-cache roots and the gateway's fallback fingerprint
all read `checkpoint_identity`; the numerics fingerprint adds `code_identity`, the code that computes a token
(a release whose kernel or model code changes a bit must not be served KV its predecessor stored on disk or in
redis). The pack cache keys its entries on `kernels.file_identity` instead (path, size, mtime of each file): a
local cache of derived bytes that must not outlive an edit of the file in place.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from pathlib import Path

from engine.gguf import find_gguf
from engine.gguf_file import SHARD, shard_name

_VERSION = b"moegate-checkpoint-v1"
_GGUF_HEAD = 1 << 24  # metadata, tensor index and the first tensors of a GGUF file
_HEADER_MAX = 100 * 2**20  # a safetensors header past this is corrupt; read no more
_DATA_HEAD = 1 << 16  # the first tensor bytes: two checkpoints of one layout differ there
_ROOT = Path(__file__).resolve().parent.parent
_CODE = ("engine/**/*.py", "kernels/**/*.py", "kernels/csrc/*")  # what computes a token's bits


def checkpoint_identity(model: str | Path) -> str:
    """sha256 (hex) over config.json and, per safetensors file, its name, size, header (every tensor's name, shape,
    dtype and byte offsets) and first data bytes; for a GGUF file (or a directory with one), each shard's name, size and head."""
    model = Path(model)
    h = hashlib.sha256(_VERSION)
    gguf_file = find_gguf(model)
    if gguf_file is not None:
        for path in _gguf_files(gguf_file):  # every shard of a split file: any of them names weights
            h.update(path.name.encode() + struct.pack("<Q", path.stat().st_size))
            with path.open("rb") as f:
                h.update(hashlib.sha256(f.read(_GGUF_HEAD)).digest())
        model = gguf_file.parent
    config = model / "config.json"
    h.update(hashlib.sha256(config.read_bytes() if config.is_file() else b"").digest())
    for path in sorted(model.glob("*.safetensors")):
        h.update(path.name.encode() + struct.pack("<Q", path.stat().st_size))
        h.update(hashlib.sha256(_safetensors_head(path)).digest())
    return h.hexdigest()


def _gguf_files(first: Path) -> list[Path]:
    """A single GGUF file, or the shards `NAME-0000i-of-0000N.gguf` of the split file whose first shard it is
    (those present: loading names a missing one)."""
    m = SHARD.match(first.name)
    if m is None:
        return [first]
    count = int(m["count"])
    return [p for i in range(count) if (p := first.with_name(shard_name(m["stem"], i + 1, count))).is_file()]


def _safetensors_head(path: Path) -> bytes:
    """The header length, the JSON header and the first data bytes of a .safetensors file."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return head
        (n,) = struct.unpack("<Q", head)
        return head + f.read(min(n, _HEADER_MAX)) + f.read(_DATA_HEAD)


def code_identity() -> str:
    """sha256 (hex) over the engine's and kernels' source files, the torch version and the compiled kernel variant
    this process runs (its SIMD builds may round differently; "torch" where the kernel is off)."""
    import torch

    from kernels.fused_moe import cpp_disabled, kernel_variant

    variant = "torch" if cpp_disabled() else kernel_variant()
    return hashlib.sha256(f"{_sources_digest()}\0{torch.__version__}\0{variant}".encode()).hexdigest()


@functools.cache
def _sources_digest() -> str:
    h = hashlib.sha256()
    for path in sorted({p for pattern in _CODE for p in _ROOT.glob(pattern) if p.is_file()}):
        h.update(path.relative_to(_ROOT).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()
