"""The checkpoint's `quantization_config` (config.json): the formats the loader can read, a clear error otherwise."""

from __future__ import annotations

from typing import Any

from engine.errors import UnsupportedCheckpointError
from engine.fp8 import BlockFp8

LOADABLE = ("fp8 (block-wise, e4m3, dynamic activations: DeepSeek-V3's format)",
            "mxfp4 (GPT-OSS's released experts, dequantized one expert at a time by engine/mxfp4.py)")


def quantization_from_hf(hf: dict[str, Any]) -> BlockFp8 | None:
    """config.json's quantization_config -> the format to dequantize on load (None: unquantized).
    Raises UnsupportedCheckpointError naming any other method."""
    qc = hf.get("quantization_config") or hf.get("compression_config")
    if not qc:
        return None
    method = qc.get("quant_method", "<no quant_method>") if isinstance(qc, dict) else repr(qc)
    if method == "fp8":
        return BlockFp8.from_quantization_config(qc)
    if method == "mxfp4" and hf.get("model_type") == "gpt_oss":
        return None  # the loader reads the experts' *_blocks / *_scales itself (engine/loader.py, engine/mxfp4.py)
    raise UnsupportedCheckpointError(
        f"config.json has quantization_config quant_method={method!r}, which moegate cannot load "
        f"(it loads {'; '.join(LOADABLE)}); use the unquantized (bf16/fp16/fp32) checkpoint, or a GGUF file"
    )
