"""The tool-call format registry: one `ToolFormat` per model family (see base.py), chosen per checkpoint.

`select_format` picks the family's format from the checkpoint's architecture (config.json `model_type`:
Kimi-K2's own `kimi_k2`, though its architecture is DeepSeek-V3's; a deepseek_v3 whose tokenizer holds Kimi's
tokens is Kimi-K2 too), if the tokenizer holds that format's special tokens as single tokens; else the Qwen format (the default,
and what random checkpoints with the ChatML template speak). `--tool-format NAME` overrides the choice.
"""

from __future__ import annotations

from .base import ToolFormat
from .deepseek import DEEPSEEK_V3, DEEPSEEK_V31
from .glm import GLM45
from .harmony import HARMONY
from .kimi import KIMI_K2
from .qwen import QWEN

FORMATS: dict[str, ToolFormat] = {f.name: f for f in (QWEN, DEEPSEEK_V31, DEEPSEEK_V3, HARMONY, GLM45, KIMI_K2)}
DEFAULT = QWEN
# model_type -> the family's format (the engine's architectures not named here speak Qwen's)
ARCH_FORMATS = {"deepseek_v3": DEEPSEEK_V31, "deepseek_v2": DEEPSEEK_V3, "gpt_oss": HARMONY, "glm4_moe": GLM45,
                "kimi_k2": KIMI_K2}


class ToolFormatError(ValueError):
    """An unknown tool-call format, or one the checkpoint's tokenizer cannot write."""


def get_format(name: str) -> ToolFormat:
    try:
        return FORMATS[name]
    except KeyError:
        raise ToolFormatError(f"unknown tool-call format {name!r}; known: {sorted(FORMATS)}") from None


def select_format(arch: str, tok, chat_template: str | None = None, override: str | None = None
                  ) -> tuple[ToolFormat, str]:
    """(format, why) for a checkpoint of `arch` whose tokenizer is `tok` (a TokenizerInfo)."""
    if override:
        fmt = get_format(override)
        if missing := fmt.missing_tokens(tok):
            raise ToolFormatError(f"--tool-format {fmt.name}: the tokenizer lacks the special token(s) {missing}")
        return fmt, "--tool-format"
    fmt = ARCH_FORMATS.get(arch, DEFAULT)
    if fmt.name == "deepseek_v31" and not KIMI_K2.missing_tokens(tok):
        fmt = KIMI_K2  # Kimi-K2 under DeepSeek-V3's model_type (its GGUF is a deepseek2 file): its tokens decide
    elif fmt.name == "deepseek_v31" and chat_template is not None and "```json" in str(chat_template):
        fmt = DEEPSEEK_V3  # a V3 / R1 template writes the fenced form
    if fmt is not DEFAULT and (missing := fmt.missing_tokens(tok)):
        return DEFAULT, f"{arch}: the tokenizer lacks {fmt.name}'s token(s) {missing[:3]}, using {DEFAULT.name}"
    return fmt, f"model_type {arch}" if fmt is not DEFAULT else "default"


__all__ = ["FORMATS", "DEFAULT", "ARCH_FORMATS", "ToolFormat", "ToolFormatError", "get_format", "select_format"]
