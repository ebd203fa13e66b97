"""A random checkpoint that speaks a family's tool-call format: the family's special tokens added to the
tokenizer as single tokens (in the embedding rows past the BPE vocabulary), its chat template and EOS."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from gateway.structured.tool_formats import ToolFormat


def add_format_tokens(tokenizer_json: dict, fmt: ToolFormat) -> dict[str, int]:
    """Adds `fmt.tokens` missing from a tokenizer.json (as special added tokens) in place -> every token's id."""
    added = {t["content"]: t["id"] for t in tokenizer_json["added_tokens"]}
    next_id = max([*added.values(), *tokenizer_json["model"]["vocab"].values()]) + 1
    for token in fmt.tokens:
        if token not in added:
            tokenizer_json["added_tokens"].append({"id": next_id, "content": token, "single_word": False,
                                                   "lstrip": False, "rstrip": False, "normalized": False,
                                                   "special": True})
            added[token], next_id = next_id, next_id + 1
    return added


def family_checkpoint(base: Path, out: Path, fmt: ToolFormat, model_type: str | None = None) -> Path:
    """A copy of the random checkpoint `base` whose tokenizer writes `fmt` (its template and EOS included);
    `model_type`: config.json's, for a release that ships the architecture under its own (kimi_k2)."""
    shutil.copytree(base, out, dirs_exist_ok=True)
    if model_type is not None:
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, "model_type": model_type}, indent=2))
    spec = json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))
    ids = add_format_tokens(spec, fmt)
    rows = json.loads((out / "config.json").read_text())["vocab_size"]
    assert max(ids.values()) < rows, f"{fmt.name}'s tokens need {max(ids.values()) + 1} embedding rows, {rows} exist"
    (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
    config = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["added_tokens_decoder"] = {str(t["id"]): {k: v for k, v in t.items() if k != "id"}
                                      for t in spec["added_tokens"]}
    config.update(chat_template=fmt.chat_template(), eos_token=fmt.eos[0])
    if "<\uff5cbegin\u2581of\u2581sentence\uff5c>" in fmt.tokens:
        config["bos_token"] = "<\uff5cbegin\u2581of\u2581sentence\uff5c>"
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2), encoding="utf-8")
    gen = json.loads((out / "generation_config.json").read_text())
    gen["eos_token_id"] = [ids[t] for t in fmt.eos]
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return out
