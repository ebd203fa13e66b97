"""A GGUF file's metadata and tensor index, parsed once, and its tensors as memory-mapped arrays.

The `gguf` package's GGUFReader parses every metadata array element by element into numpy views:
about a minute for a Qwen vocabulary (151k tokens, 151k merges) on these machines, each time a file
is opened. This reader walks the header with `struct` (about a second for the same file) and maps a
tensor's bytes only when it is read; `gguf.quants` still does the dequantizing.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.errors import CheckpointError

_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


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


@functools.lru_cache(maxsize=4)
def _open(path: str, size: int, mtime_ns: int) -> GgufFile:
    return GgufFile(Path(path))


def open_gguf(path: str | Path) -> GgufFile:
    """The parsed file, shared while it is unchanged (the config, the loader and the tokenizer all read it)."""
    st = Path(path).stat()
    return _open(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)
