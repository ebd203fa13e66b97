"""A GGUF model's metadata and tensor index, parsed once, and its tensors as memory-mapped arrays.

A model is one file or llama.cpp's split layout (gguf-split, convert_hf_to_gguf --split-max-*):
`NAME-00001-of-0000N.gguf` ... `NAME-0000N-of-0000N.gguf`, every shard stamped with `split.no`
(0-based), `split.count` and `split.tensors.count`, the model's metadata in the first, its tensors
spread over all of them. `open_gguf` takes the first shard (or a single file) and returns one view.

The `gguf` package's GGUFReader parses every metadata array element by element into numpy views:
about a minute for a Qwen vocabulary (151k tokens, 151k merges) on these machines, each time a file
is opened. This reader walks the header with `struct` (about a second for the same file) and maps a
tensor's bytes only when it is read; `gguf.quants` still does the dequantizing.
"""

from __future__ import annotations

import functools
import glob
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import CheckpointError

_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
SHARD = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (outermost first)
    qtype: int  # gguf.GGMLQuantizationType value
    offset: int  # from the start of the file
    nbytes: int


class _Short(Exception):
    """The header runs past the bytes read so far."""


class _Cursor:
    def __init__(self, buf: bytes) -> None:
        self.buf, self.pos = buf, 0

    def scalar(self, fmt: str) -> Any:
        if self.pos + 8 > len(self.buf):
            raise _Short
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        self.pos += n
        if self.pos > len(self.buf):
            raise _Short
        return self.buf[self.pos - n : self.pos].decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        buf, pos, out, unpack = self.buf, self.pos, [], struct.Struct("<Q").unpack_from
        for _ in range(count):
            (n,) = unpack(buf, pos)
            out.append(buf[pos + 8 : pos + 8 + n].decode("utf-8", errors="replace"))
            pos += 8 + n
        if pos > len(buf):
            raise _Short
        self.pos = pos
        return out

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            elem, count = self.scalar("<I"), self.scalar("<Q")
            if elem == _STRING:
                return self.strings(count)
            if elem in _SCALARS and elem != 7:  # numbers: one numpy read
                dtype = np.dtype(_SCALARS[elem])
                if self.pos + dtype.itemsize * count > len(self.buf):
                    raise _Short
                out = np.frombuffer(self.buf, dtype, count, self.pos).tolist()
                self.pos += dtype.itemsize * count
                return out
            return [self.value(elem) for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {kind}")
        return self.scalar(_SCALARS[kind])


class GgufFile:
    """`meta`: every key -> value; `tensors`: name -> TensorInfo, in file order."""

    def __init__(self, path: Path) -> None:
        import gguf

        self.path = path
        try:
            with open(path, "rb") as fh:
                self._map = np.memmap(fh, dtype=np.uint8, mode="r")
                size = 1 << 24
                while True:  # read the head of the file, more while the header runs past it
                    fh.seek(0)
                    try:
                        infos, start = self._parse(fh.read(size))
                        break
                    except _Short:
                        if size >= self._map.size:
                            raise ValueError("the header runs past the end of the file") from None
                        size *= 4
        except (ValueError, struct.error, UnicodeDecodeError, OSError) as exc:
            raise CheckpointError(f"cannot read {path.name} as GGUF: {exc} (corrupt or truncated file?)") from exc
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, qtype, offset in infos:
            if qtype not in gguf.GGML_QUANT_SIZES:
                raise CheckpointError(f"GGUF tensor {name} has unknown type {qtype}")
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
            nbytes = int(np.prod(shape)) // block * size
            if start + offset + nbytes > self._map.size:
                raise CheckpointError(f"{path.name}: tensor {name} runs past the end of the file (truncated?)")
            self.tensors[name] = TensorInfo(name, shape, qtype, start + offset, nbytes)

    def _parse(self, head: bytes) -> tuple[list, int]:
        cur = _Cursor(head)
        if head[:4] != _MAGIC:
            raise ValueError("no GGUF magic")
        cur.pos = 4
        version, n_tensors, n_kv = cur.scalar("<I"), cur.scalar("<Q"), cur.scalar("<Q")
        if version < 2:
            raise ValueError(f"GGUF version {version} (moegate reads 2 and 3)")
        self.meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.meta[key] = cur.value(cur.scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name, n_dims = cur.string(), cur.scalar("<I")
            dims = [cur.scalar("<Q") for _ in range(n_dims)]
            infos.append((name, tuple(reversed(dims)), cur.scalar("<I"), cur.scalar("<Q")))
        align = int(self.meta.get("general.alignment", 32))
        return infos, -(-cur.pos // align) * align

    def raw(self, name: str) -> np.ndarray:
        """The tensor's stored values as gguf.quants.dequantize takes them: [..., row bytes] for block types."""
        import gguf

        info = self.tensors[name]
        data = self._map[info.offset : info.offset + info.nbytes]
        kind = gguf.GGMLQuantizationType(info.qtype)
        typed = {gguf.GGMLQuantizationType.F32: np.float32, gguf.GGMLQuantizationType.F16: np.float16}
        if kind in typed:
            return data.view(typed[kind]).reshape(info.shape)
        block, size = gguf.GGML_QUANT_SIZES[kind]
        return data.reshape(*info.shape[:-1], info.shape[-1] // block * size)


def shard_name(stem: str, no: int, count: int) -> str:
    """llama.cpp's split file name (gguf-split's and GGUFWriter's `{stem}-{no:05d}-of-{count:05d}.gguf`, 1-based)."""
    return f"{stem}-{no:05d}-of-{count:05d}.gguf"


class GgufModel:
    """One GGUF file or the shards of a split one, seen as one: `meta` (the first shard's), `tensors` (all)."""

    def __init__(self, first: Path) -> None:
        head = GgufFile(first)
        self.path, self.meta = first, head.meta
        count, no = int(head.meta.get("split.count", 1)), int(head.meta.get("split.no", 0))
        if no != 0:
            raise CheckpointError(f"{first.name} is shard {no + 1} of a split GGUF: give the first shard "
                                  f"(...-00001-of-{count:05d}.gguf) or the directory")
        self.shards = [head]
        if count > 1:
            m = SHARD.match(first.name)
            if m is None or int(m["count"]) != count:
                raise CheckpointError(f"{first.name} says split.count={count} but is not named like its shards "
                                      f"(NAME-00001-of-{count:05d}.gguf)")
            for i in range(1, count):
                path = first.with_name(shard_name(m["stem"], i + 1, count))
                if not path.is_file():
                    raise CheckpointError(f"split GGUF {first.name}: shard {path.name} ({i + 1} of {count}) is missing")
                shard = GgufFile(path)
                found = (shard.meta.get("split.no"), shard.meta.get("split.count"))
                if found != (i, count):
                    raise CheckpointError(f"split GGUF {first.name}: {path.name} is split.no={found[0]} of "
                                          f"split.count={found[1]}, expected split.no={i} of {count} (a shard of "
                                          "another model or conversion?)")
                self.shards.append(shard)
        self.tensors: dict[str, TensorInfo] = {}
        self._owner: dict[str, GgufFile] = {}
        for shard in self.shards:
            for name, info in shard.tensors.items():
                if name in self.tensors:
                    raise CheckpointError(f"GGUF tensor {name} is in both {self._owner[name].path.name} and "
                                          f"{shard.path.name}")
                self.tensors[name], self._owner[name] = info, shard
        expected = head.meta.get("split.tensors.count", len(self.tensors))
        if count > 1 and expected != len(self.tensors):
            raise CheckpointError(f"split GGUF {first.name}: the shards hold {len(self.tensors)} tensors, "
                                  f"split.tensors.count says {expected}")

    @property
    def paths(self) -> list[Path]:
        return [shard.path for shard in self.shards]

    def raw(self, name: str) -> np.ndarray:
        return self._owner[name].raw(name)


@functools.lru_cache(maxsize=4)
def _open(path: str, stats: tuple) -> GgufModel:
    return GgufModel(Path(path))


def open_gguf(path: str | Path) -> GgufModel:
    """The parsed model (`path`: a single file or the first shard), shared while its files are unchanged
    (the config, the loader and the tokenizer all read it)."""
    path = Path(path).resolve()
    m = SHARD.match(path.name)
    if not path.is_file():
        what = f"shard {path.name} (1 of {int(m['count'])})" if m else path.name
        raise CheckpointError(f"GGUF {what} is missing in {path.parent}")
    files = [path] + (sorted(path.parent.glob(f"{glob.escape(m['stem'])}-*-of-{m['count']}.gguf")) if m else [])
    return _open(str(path), tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files))
