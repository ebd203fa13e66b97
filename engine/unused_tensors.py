"""Checkpoint tensors known to be unused, each with its reason; any other unexpected tensor is an error.

A tensor the model has no place for would otherwise be dropped silently, and a checkpoint whose
weights mean something else (a quantized layout, another variant) would load and compute garbage.
"""

from __future__ import annotations

import re

from engine.config import ModelConfig
from engine.errors import UnexpectedTensorError

# reason -> names (regex, searched) that are safe to skip whatever the model
_ALWAYS_UNUSED = {
    "RoPE inverse frequencies, recomputed from config.json": re.compile(r"rotary_emb\.inv_freq$"),
}
# names that mark a quantized or adapter layout: the hint for the error
_QUANTIZED = re.compile(r"\.(weight_scale_inv|weight_scale|input_scale|qweight|qzeros|scales|g_idx|SCB|absmax|lora_[AB]\.\w+)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def unused_reason(name: str, cfg: ModelConfig, extra_layers: int = 0) -> str | None:
    """Why `name` may be skipped, or None when it must not be.

    `extra_layers`: layers stored past `num_hidden_layers` that decoding does not run (DeepSeek-V3's and
    GLM-4.5's multi-token-prediction layers, `num_nextn_predict_layers` in config.json); the first one is loaded
    instead, and so never reaches here, when MTP drafts are asked for (engine/mtp.py).
    """
    for reason, pattern in _ALWAYS_UNUSED.items():
        if pattern.search(name):
            return reason
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return "a copy of the tied input embeddings"
    if name.startswith("mtp.") and cfg.arch == "qwen3_next":
        return "Qwen3-Next's multi-token-prediction module (mtp.*), unused by decoding"
    m = _LAYER.match(name)
    if m and extra_layers and cfg.num_layers <= int(m.group(1)) < cfg.num_layers + extra_layers:
        return "a multi-token-prediction layer (num_nextn_predict_layers), loaded only for MTP drafts"
    return None


def check_unexpected(names: list[str], cfg: ModelConfig, extra_layers: int = 0) -> None:
    """Raises UnexpectedTensorError naming every tensor in `names` that is not known to be unused."""
    bad = sorted(n for n in names if unused_reason(n, cfg, extra_layers) is None)
    if not bad:
        return
    hint = ""
    if any(_QUANTIZED.search(n) for n in bad):
        hint = ("these look like quantization or adapter tensors, but config.json has no supported "
                "quantization_config for them")
    raise UnexpectedTensorError(bad, hint)
