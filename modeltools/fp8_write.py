"""A block-FP8 checkpoint (DeepSeek-V3's format, engine/fp8.py) written from an unquantized one."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from engine.fp8 import SCALE_SUFFIX, BlockFp8

# what DeepSeek-V3 stores in fp8: every projection weight (attention, experts, shared experts, dense MLPs)
_QUANTIZED = re.compile(r"_proj\.weight$|\.w[123]\.weight$")


def quantize_checkpoint(src: str | Path, dst: str | Path, block: tuple[int, int] = (128, 128)) -> Path:
    """Copies an unquantized safetensors checkpoint to `dst` with its projection weights in block FP8."""
    src, dst = Path(src), Path(dst)
    fmt = BlockFp8(block)
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.suffix != ".safetensors" and path.is_file():
            shutil.copy2(path, dst / path.name)
    weight_map = {}
    for path in sorted(src.glob("*.safetensors")):
        out = {}
        for name, t in load_file(str(path)).items():
            if _QUANTIZED.search(name) and t.ndim == 2:
                out[name], out[name + SCALE_SUFFIX] = fmt.quantize(t)
            else:
                out[name] = t
        save_file(out, str(dst / path.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(out, path.name))
    if (src / "model.safetensors.index.json").is_file():
        (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst
