"""The checkpoint's `quantization_config` (config.json): the formats the loader can read, a clear error otherwise."""

from __future__ import annotations

from typing import Any

from engine.errors import UnsupportedCheckpointError


def quantization_from_hf(hf: dict[str, Any]) -> None:
    """Checks config.json's quantization_config; raises UnsupportedCheckpointError naming an unsupported method."""
    qc = hf.get("quantization_config") or hf.get("compression_config")
    if not qc:
        return None
    method = qc.get("quant_method", "<no quant_method>") if isinstance(qc, dict) else repr(qc)
    raise UnsupportedCheckpointError(
        f"config.json has quantization_config quant_method={method!r}, which moegate cannot load; "
        "use the unquantized (bf16/fp16/fp32) checkpoint, or a GGUF file"
    )
