"""Load a Hugging Face MoE checkpoint into MoeForCausalLM by parameter name, one tensor at a time.

Both on-disk expert layouts are accepted: per-expert hub names
(`mlp.experts.{e}.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.{e}.w1.weight`) and the
fused layout (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from engine.config import ModelConfig
from engine.errors import CheckpointError, MissingTensorError, TensorShapeError
from engine.models.causal_lm import MoeForCausalLM

log = logging.getLogger(__name__)

_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")
_CANONICAL = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


@dataclass(frozen=True)
class _Target:
    """Where one checkpoint tensor goes: a parameter, optionally a slice [expert, rows]."""

    param: str
    expert: int | None = None
    rows: slice | None = None


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    return files


def _target(name: str, intermediate: int) -> tuple[str, _Target]:
    """Maps a checkpoint tensor name to (a key naming the covered slot, its target)."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    m = _PER_EXPERT.match(name)
    if not m:
        return name, _Target(name)
    prefix, expert = m.group(1), int(m.group(2))
    part = _CANONICAL.get(m.group(3), m.group(3))
    key = f"{prefix}.{expert}.{part}.weight"
    if part == "down_proj":
        return key, _Target(f"{prefix}.down_proj", expert)
    rows = slice(0, intermediate) if part == "gate_proj" else slice(intermediate, 2 * intermediate)
    return key, _Target(f"{prefix}.gate_up_proj", expert, rows)


def _expected_names(model: MoeForCausalLM, cfg: ModelConfig) -> dict[str, str]:
    """Checkpoint-style names of every slot the model needs -> the parameter that holds it."""
    names = {}
    for pname, _ in model.named_parameters():
        if cfg.tie_word_embeddings and pname == "lm_head.weight":
            continue
        if pname.endswith("experts.gate_up_proj") or pname.endswith("experts.down_proj"):
            prefix = pname.rsplit(".", 1)[0]
            parts = ("gate_proj", "up_proj") if pname.endswith("gate_up_proj") else ("down_proj",)
            for e in range(cfg.num_experts):
                for part in parts:
                    names[f"{prefix}.{e}.{part}.weight"] = pname
        else:
            names[pname] = pname
    return names


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> MoeForCausalLM:
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = MoeForCausalLM(cfg).to(dtype)
    model.to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty materialises each module's parameters separately: re-tie
        model.lm_head.weight = model.model.embed_tokens.weight
    for module in model.modules():
        if hasattr(module, "inv_freq"):  # non-persistent RoPE buffer: recompute in fp32
            module.__init__(cfg.head_dim, cfg.rope_theta)
            module.to(device)
    params = dict(model.named_parameters())
    expected = _expected_names(model, cfg)
    covered: set[str] = set()

    files = checkpoint_files(model_dir)
    bar = tqdm(total=sum(f.stat().st_size for f in files), unit="B", unit_scale=True,
               desc=f"load {model_dir.name}", disable=not progress)
    with torch.no_grad():
        for path in files:
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(f"cannot read {path.name}: {exc} (corrupt or truncated file?)") from exc
            with handle as f:
                for name in f.keys():
                    if _IGNORED.search(name):
                        continue
                    key, tgt = _target(name, cfg.moe_intermediate_size)
                    if tgt.param not in params:
                        log.warning("ignoring unexpected tensor %s in %s", name, path.name)
                        continue
                    try:
                        tensor = f.get_tensor(name)
                    except (SafetensorError, OSError) as exc:
                        raise CheckpointError(f"cannot read tensor {name!r} from {path.name}: {exc}") from exc
                    _copy(params[tgt.param], tgt, name, tensor)
                    bar.update(tensor.numel() * tensor.element_size())
                    if tgt.expert is None and tgt.param.endswith(("experts.gate_up_proj", "experts.down_proj")):
                        covered.update(k for k, p in expected.items() if p == tgt.param)
                    else:
                        covered.add(key if tgt.expert is not None else tgt.param)
    bar.close()
    missing = [n for n in expected if n not in covered]
    if missing:
        raise MissingTensorError(missing)
    model.eval()
    return model


def _copy(param: torch.Tensor, tgt: _Target, name: str, tensor: torch.Tensor) -> None:
    dest = param
    if tgt.expert is not None:
        dest = dest[tgt.expert]
    if tgt.rows is not None:
        dest = dest[tgt.rows]
    if tuple(dest.shape) != tuple(tensor.shape):
        raise TensorShapeError(name, tuple(dest.shape), tuple(tensor.shape))
    dest.copy_(tensor)
