"""On-disk cache of packed experts (safetensors, atomic writes, checksummed) so a reload skips packing.

An entry is keyed by (name, source identity, fmt, group size, LAYOUT_VERSION). The source identity is
either a caller-supplied string (e.g. checkpoint path + mtime + size) or a blake2b hash of the source
tensors' bytes and shapes. The file stores the full key and a blake2b checksum of the packed tensors
in its metadata; an entry whose key or checksum disagrees, or that does not parse, is deleted and
rebuilt, never used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
import tempfile
from pathlib import Path
from typing import BinaryIO

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from kernels.formats import DEFAULT_GROUP_SIZE, LAYOUT_VERSION, FormatError, PackedExperts, pack_experts

log = logging.getLogger(__name__)


def tensor_digest(*tensors: torch.Tensor) -> str:
    """blake2b over shapes, dtypes and raw bytes of CPU tensors (the default source identity)."""
    h = hashlib.blake2b(digest_size=16)
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(f"{tuple(t.shape)}|{t.dtype}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def file_identity(path: str | os.PathLike) -> str:
    """A cheap source identity for tensors read from a checkpoint file: path, size and mtime."""
    st = os.stat(path)
    return f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}"


def _packed_checksum(sd: dict[str, torch.Tensor]) -> str:
    return tensor_digest(*(sd[k] for k in sorted(sd)))


class PackCache:
    """Directory of packed-expert entries; ``hits`` / ``misses`` / ``rejected`` count lookups."""

    def __init__(self, directory: str | os.PathLike, verify: bool = True) -> None:
        self.directory = Path(directory)
        self.verify = verify
        self.hits = self.misses = self.rejected = 0

    def key(self, name: str, source: str, fmt: str, group_size: int | None, shapes: str = "") -> str:
        gs = DEFAULT_GROUP_SIZE.get(fmt, 0) if group_size is None else group_size
        return f"{name}|{shapes}|{source}|{fmt}|g{gs}|layout{LAYOUT_VERSION}"

    def path_for(self, key: str, name: str) -> Path:
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)[:80]
        return self.directory / f"{safe}-{hashlib.sha256(key.encode()).hexdigest()[:20]}.safetensors"

    def load(self, key: str, name: str) -> PackedExperts | None:
        """The cached entry for ``key``, or None if absent; a bad entry is deleted and counted as rejected."""
        path = self.path_for(key, name)
        if not path.exists():
            return None
        try:
            sd = load_file(path)
            with open(path, "rb") as f:  # metadata: safetensors header is <u64 length><json>
                meta = _read_metadata(f)
            if meta.get("key") != key:
                raise FormatError(f"entry key {meta.get('key')!r} != {key!r}")
            if self.verify and meta.get("checksum") != _packed_checksum(sd):
                raise FormatError("checksum mismatch")
            return PackedExperts.from_state_dict(sd)
        except (SafetensorError, FormatError, OSError, ValueError, KeyError) as exc:
            log.warning("dropping bad pack-cache entry %s (%s); repacking", path, exc)
            self.rejected += 1
            path.unlink(missing_ok=True)
            return None

    def store(self, key: str, name: str, packed: PackedExperts) -> Path:
        """Write atomically (temp file in the same directory, fsync, rename)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path_for(key, name)
        sd = packed.state_dict()
        meta = {"key": key, "checksum": _packed_checksum(sd)}
        fd, tmp = tempfile.mkstemp(dir=self.directory, suffix=".tmp")
        os.close(fd)
        try:
            save_file(sd, tmp, metadata=meta)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return path

    def get_or_pack(self, name: str, w_gate_up: torch.Tensor, w_down: torch.Tensor, fmt: str,
                    group_size: int | None = None, source: str | None = None, progress: bool = True,
                    expert_ids: tuple[int, ...] | None = None) -> PackedExperts:
        """Packed experts for (name, source, fmt, group size): from disk if cached, else packed and stored.

        ``source`` identifies the source weights (see ``file_identity``); by default their bytes are hashed.
        """
        source = source if source is not None else tensor_digest(w_gate_up, w_down)
        shapes = f"{tuple(w_gate_up.shape)}x{tuple(w_down.shape)}"
        if expert_ids is not None:  # the same weights under other global ids are another entry
            shapes += "|ids" + hashlib.sha256(repr(tuple(expert_ids)).encode()).hexdigest()[:12]
        key = self.key(name, source, fmt, group_size, shapes)
        cached = self.load(key, name)
        if cached is not None:
            self.hits += 1
            return cached
        self.misses += 1
        packed = pack_experts(w_gate_up, w_down, fmt, group_size, progress=progress, expert_ids=expert_ids)
        self.store(key, name, packed)
        return packed


def _read_metadata(f: BinaryIO) -> dict[str, str]:
    (n,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(n))
    return header.get("__metadata__", {})
