"""The model's tokenizer as constraint backends see it: token bytes, specials, EOS, a content hash."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode, used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


@dataclass(frozen=True)
class TokenizerInfo:
    """A tokenizer.json (HF `tokenizers` format) plus the model's EOS ids; built offline."""

    path: str
    eos_ids: tuple[int, ...]
    hash: str = field(compare=False)
    json_text: str = field(repr=False, compare=False)

    @classmethod
    def from_file(cls, path: str | os.PathLike, eos_ids: tuple[int, ...] | list[int]) -> TokenizerInfo:
        return _load(str(Path(path).resolve()), tuple(int(i) for i in eos_ids))

    @classmethod
    def from_json(cls, text: str, eos_ids: tuple[int, ...] | list[int], origin: str) -> TokenizerInfo:
        """From tokenizer.json text held in memory (e.g. rebuilt from a GGUF file); `origin` names its source."""
        eos = tuple(int(i) for i in eos_ids)
        if not eos:
            raise ValueError("TokenizerInfo needs at least one EOS id (the model's end-of-turn tokens)")
        digest = hashlib.sha256(text.encode() + repr(eos).encode()).hexdigest()[:16]
        return cls(path=origin, eos_ids=eos, hash=digest, json_text=text)

    @functools.cached_property
    def _spec(self) -> dict:
        return json.loads(self.json_text)

    @functools.cached_property
    def special_ids(self) -> dict[str, int]:
        return {t["content"]: int(t["id"]) for t in self._spec.get("added_tokens", []) if t.get("special")}

    @functools.cached_property
    def token_bytes(self) -> list[bytes | None]:
        """Bytes of every id (None for holes and special tokens), index = token id."""
        spec = self._spec
        vocab: dict[str, int] = spec["model"]["vocab"]
        if isinstance(vocab, list):  # Unigram: [[piece, score], ...]
            vocab = {piece: i for i, (piece, _) in enumerate(vocab)}
        byte_level = "ByteLevel" in json.dumps(spec.get("decoder") or {}) or "ByteLevel" in json.dumps(
            spec.get("pre_tokenizer") or {}
        )
        u2b = _unicode_to_byte()
        size = max([*vocab.values(), *(int(t["id"]) for t in spec.get("added_tokens", [])), -1]) + 1
        out: list[bytes | None] = [None] * size
        for piece, i in vocab.items():
            if byte_level:
                out[i] = bytes(u2b[c] for c in piece) if all(c in u2b for c in piece) else piece.encode()
            elif m := _BYTE_FALLBACK.match(piece):
                out[i] = bytes([int(m.group(1), 16)])
            else:
                out[i] = piece.replace("\u2581", " ").encode()
        for t in spec.get("added_tokens", []):
            out[int(t["id"])] = None if t.get("special") else t["content"].encode()
        return out

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer defines (the model's logits may be wider: padding)."""
        return len(self.token_bytes)

    @functools.cached_property
    def added_ids(self) -> dict[str, int]:
        """Every added token (special or not: Qwen's `<tool_call>` is added with special=false)."""
        return {t["content"]: int(t["id"]) for t in self._spec.get("added_tokens", [])}

    def token_id(self, special: str) -> int:
        try:
            return self.added_ids[special]
        except KeyError:
            raise KeyError(f"tokenizer {self.path} has no added token {special!r}") from None

    @functools.cached_property
    def hf(self):
        from tokenizers import Tokenizer

        return Tokenizer.from_str(self.json_text)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=False)

    def warm(self) -> TokenizerInfo:
        """Builds the per-tokenizer tables every compile needs (seconds for a 151k vocabulary on a busy machine),
        so that no compile's time limit pays for them."""
        _ = self.llg, self.token_bytes
        return self

    @functools.cached_property
    def llg(self):
        """llguidance LLTokenizer over this vocabulary (~1 s for 151k ids; cached per tokenizer)."""
        import llguidance

        return llguidance.LLTokenizer(self.json_text, n_vocab=self.vocab_size, eos_token=list(self.eos_ids))

    @functools.cached_property
    def outlines_vocabulary(self):
        """outlines-core Vocabulary built from token bytes (no hub access); specials excluded."""
        import outlines_core

        by_bytes: dict[bytes, list[int]] = {}
        for i, b in enumerate(self.token_bytes):
            if b and i not in self.eos_ids:
                by_bytes.setdefault(b, []).append(i)
        return outlines_core.Vocabulary(self.eos_ids[0], by_bytes)


@functools.lru_cache(maxsize=8)
def _load(path: str, eos_ids: tuple[int, ...]) -> TokenizerInfo:
    if not eos_ids:
        raise ValueError("TokenizerInfo needs at least one EOS id (the model's end-of-turn tokens)")
    text = Path(path).read_text(encoding="utf-8")
    digest = hashlib.sha256(text.encode() + repr(eos_ids).encode()).hexdigest()[:16]
    return TokenizerInfo(path=path, eos_ids=eos_ids, hash=digest, json_text=text)
