"""The tokenizer a GGUF file carries in its metadata, as a Hugging Face tokenizer.json.

llama.cpp's converter stores a byte-level BPE vocabulary as `tokenizer.ggml.model = gpt2`: every token
string (already in GPT-2's byte-to-unicode alphabet), a type per token (normal, control, user-defined,
unused, byte), the merges, and the pre-tokenizer's name (`tokenizer.ggml.pre`). The pre-tokenizers
rebuilt here are the ones the supported GGUF architectures use (Qwen2/Qwen3: "qwen2"); any other
vocabulary needs the model's tokenizer.json beside the .gguf file, and the error says so.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from engine.errors import CheckpointError
from engine.gguf_file import open_gguf
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

NORMAL, CONTROL, USER_DEFINED = 1, 3, 4
_SPLIT = {
    "qwen2": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+", {"type": "NFC"}),
}
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}


def tokenizer_json(meta: dict[str, Any]) -> str:
    """tokenizer.json text from a GGUF's `tokenizer.*` metadata; CheckpointError when it cannot be rebuilt."""
    model, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if model != "gpt2" or pre not in _SPLIT:
        raise CheckpointError(
            f"the GGUF's tokenizer (model {model!r}, pre-tokenizer {pre!r}) is not one moegate rebuilds "
            f"(gpt2 with {', '.join(_SPLIT)}): put the model's tokenizer.json beside the .gguf file")
    tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type") or []
    types = list(types) + [NORMAL] * (len(tokens) - len(types))
    regex, normalizer = _SPLIT[pre]
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": k == CONTROL} for i, (t, k) in enumerate(zip(tokens, types, strict=True))
             if k in (CONTROL, USER_DEFINED)]
    return json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": normalizer,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}, _BYTE_LEVEL]},
        "post_processor": _BYTE_LEVEL, "decoder": _BYTE_LEVEL,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, (t, k) in enumerate(zip(tokens, types, strict=True)) if k == NORMAL},
                  "merges": [m.split(" ", 1) for m in meta.get("tokenizer.ggml.merges") or []]},
    }, ensure_ascii=False)


def load_tokenizer(path: Path):
    """engine.tokenizer.Tokenizer from a GGUF file's metadata (chat template and EOS included)."""

    meta = open_gguf(path).meta
    if "tokenizer.ggml.tokens" not in meta:
        raise CheckpointError(f"{path.name} carries no tokenizer: put the model's tokenizer.json beside it")
    tokens = meta["tokenizer.ggml.tokens"]
    config: dict[str, Any] = {"add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False))}
    for key in ("bos", "eos", "padding"):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and 0 <= token_id < len(tokens):
            config[f"{'pad' if key == 'padding' else key}_token"] = tokens[token_id]
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return Tokenizer(tokenizer_json(meta).encode("utf-8"), config,
                     {"eos_token_id": eos} if eos is not None else {}, meta.get("tokenizer.chat_template"))


def load_model_tokenizer(model_path: Path):
    """tokenizer.json of the model's directory, else the tokenizer a GGUF file carries, else None."""
    from engine.gguf import find_gguf, model_dir_of

    model_dir = model_dir_of(model_path)
    gguf_file = find_gguf(model_path)
    if not (model_dir / "tokenizer.json").is_file() and gguf_file is not None:
        try:
            return load_tokenizer(gguf_file)
        except CheckpointError as exc:
            log.warning("%s: prompts must be token ids and no text is produced", exc)
            return None
    if not (model_dir / "tokenizer.json").is_file():
        log.warning("%s has no tokenizer.json: prompts must be token ids and no text is produced", model_dir)
        return None
    return Tokenizer.from_dir(model_dir)
