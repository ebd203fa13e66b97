"""A multi-token-prediction layer added to a saved DeepSeek-V3 / GLM-4.5 checkpoint (`model.layers.{L}.*`).

The decoder block is layer L of the same family built by transformers with one more layer (its own
initialisation under `seed`, saved under hub names), beside the MTP's own tensors: enorm, hnorm, eh_proj,
shared_head.norm, and copies of the main embedding and lm_head as embed_tokens and shared_head.head (as
DeepSeek-V3 ships them). config.json gets `num_nextn_predict_layers: 1` (transformers writes DeepSeek-V3's default 1 with no tensors).

`mirror=True` builds a layer whose drafts mean something without training: its block is a copy of the main
model's last decoder layer, eh_proj passes the next token's embedding through (enorm's weight the embedding
rows' mean RMS, so its output is about the raw embedding), shared_head.norm is the main model's final norm.
On a one-layer main model the layer at position i then computes what the main model computes at position i+1:
the same layer over the same tokens at the same relative positions (RoPE), only the first two tokens missing
from its context (the embedding at position 0 is zero) and the embedding's scale approximate, so its drafts
are the main model's next choice up to those differences. On a deeper model it is the last layer's part only.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.archs import arch_spec
from modeltools.random_checkpoint import _random_model

FILE = "model-mtp.safetensors"


def _read_all(model_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


def add_mtp_layer(model_dir: str | Path, seed: int = 0, mirror: bool = False) -> Path:
    """Writes the layer into `model_dir` (FILE, the index's weight map where there is one) -> its path."""
    import transformers

    model_dir = Path(model_dir)
    hf = json.loads((model_dir / "config.json").read_text())
    arch = hf["model_type"]
    if arch not in ("deepseek_v3", "glm4_moe"):
        raise ValueError(f"MTP layers are DeepSeek-V3's and GLM-4.5's, not {arch!r}")
    layers = hf["num_hidden_layers"]
    config_cls, model_cls = (getattr(transformers, name) for name in arch_spec(arch).hf_classes)
    config = config_cls.from_pretrained(model_dir)
    config.num_hidden_layers = layers + 1
    with tempfile.TemporaryDirectory() as tmp:
        _random_model(model_cls, config, seed).save_pretrained(tmp, safe_serialization=True)
        block = {n: t for n, t in _read_all(Path(tmp)).items() if n.startswith(f"model.layers.{layers}.")}
    main = _read_all(model_dir)
    if any(n.startswith(f"model.layers.{layers}.") for n in main):
        raise ValueError(f"{model_dir} already stores a layer past its {layers} decoder layers")
    prefix, h = f"model.layers.{layers}", hf["hidden_size"]
    gen = torch.Generator().manual_seed(seed + 2)
    dtype = main["model.embed_tokens.weight"].dtype
    head = main.get("lm_head.weight", main["model.embed_tokens.weight"])
    tensors = dict(block)
    tensors.update({
        f"{prefix}.embed_tokens.weight": main["model.embed_tokens.weight"].clone(),
        f"{prefix}.shared_head.head.weight": head.clone(),
        f"{prefix}.enorm.weight": 1.0 + 0.1 * torch.randn(h, generator=gen),
        f"{prefix}.hnorm.weight": 1.0 + 0.1 * torch.randn(h, generator=gen),
        f"{prefix}.shared_head.norm.weight": 1.0 + 0.1 * torch.randn(h, generator=gen),
        f"{prefix}.eh_proj.weight": 0.02 * torch.randn(h, 2 * h, generator=gen),
    })
    if mirror:
        last = f"model.layers.{layers - 1}."
        copy = {prefix + n.removeprefix(last[:-1]): t.clone() for n, t in main.items() if n.startswith(last)}
        if set(copy) != set(block):
            raise ValueError(f"the last decoder layer is not the MTP block's kind (dense vs MoE): {model_dir}")
        embed = main["model.embed_tokens.weight"].float()
        tensors.update(copy)
        tensors[f"{prefix}.enorm.weight"] = embed.pow(2).mean(-1).sqrt().mean().expand(h).clone()
        tensors[f"{prefix}.eh_proj.weight"] = torch.cat((torch.eye(h), torch.zeros(h, h)), dim=1)
        tensors[f"{prefix}.shared_head.norm.weight"] = main["model.norm.weight"].clone()
    tensors = {n: t.to(dtype).contiguous() for n, t in tensors.items()}
    save_file(tensors, model_dir / FILE, metadata={"format": "pt"})
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"].update(dict.fromkeys(tensors, FILE))
        index.write_text(json.dumps(data, indent=2))
    hf["num_nextn_predict_layers"] = 1
    (model_dir / "config.json").write_text(json.dumps(hf, indent=2))
    return model_dir / FILE


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser(description="add a multi-token-prediction layer to a DeepSeek-V3 / GLM-4.5 checkpoint")
    ap.add_argument("model_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mirror", action="store_true", help="a copy of the last decoder layer (see the module docstring)")
    args = ap.parse_args()
    print(add_mtp_layer(args.model_dir, args.seed, args.mirror))


if __name__ == "__main__":
    main()
