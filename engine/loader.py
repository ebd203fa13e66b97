"""Load a Hugging Face MoE checkpoint into MoeForCausalLM by parameter name, streaming.

The model is built on the `meta` device; each tensor is read from the memory-mapped safetensors
(all files open at once, so an expert split across shards is found) and materialised where the
placement plan puts it: dense tensors on the fast device, routed experts packed one at a time into
host shards (`engine.expert_stream`). Both on-disk expert layouts are accepted: per-expert hub names
(`mlp.experts.{e}.gate_proj.weight`, Mixtral's `block_sparse_moe.experts.{e}.w1.weight`) and the
fused layout (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]; GPT-OSS's
transposed [E, H, 2I] with gate/up columns interleaved, [E, I, H], and their biases: `ArchSpec.fused_experts`;
its released MXFP4 `*_blocks` / `*_scales` are dequantized one expert at a time: engine/mxfp4.py). Missing
tensors, wrong shapes and tensors the model has no place for (unless `engine.unused_tensors` knows them
to be unused) are reported from the headers before anything is loaded.
Other formats are checkpoint views with the same interface: block-FP8 safetensors (`engine.fp8`) and
GGUF files (`engine.gguf`), both dequantized tensor by tensor as they are read.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm.auto import tqdm

from engine.archs import arch_spec
from engine.config import ModelConfig, read_hf_config
from engine.errors import CheckpointError, MissingTensorError, TensorShapeError
from engine.experts import PlacementConfig, plan_layers
from engine.fp8 import BlockFp8Checkpoint
from engine.gguf import GgufCheckpoint, find_gguf
from engine.models.causal_lm import MoeForCausalLM
from engine.mtp import MtpLayer, mtp_config, share_main_tensors
from engine.mxfp4 import dequantize_mxfp4
from engine.placement_plan import PlacementPlan
from engine.unused_tensors import check_unexpected
from kernels import file_identity

log = logging.getLogger(__name__)

_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_MXFP4 = re.compile(r"^(.*\.experts\.(?:gate_up_proj|down_proj))_(blocks|scales)$")
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


def _target(name: str, intermediate: int, renames: tuple[tuple[str, str], ...] = ()) -> tuple[str, _Target]:
    """Maps a checkpoint tensor name to (a key naming the covered slot, its target)."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    for old, new in renames:
        name = name.replace(old, new)
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


class _Checkpoint:
    """Every safetensors file of a directory open at once (memory-mapped), tensors found by name."""

    def __init__(self, model_dir: Path) -> None:
        self.files = checkpoint_files(model_dir)
        self.handles, self.where = [], {}
        for path in self.files:
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(f"cannot read {path.name}: {exc} (corrupt or truncated file?)") from exc
            self.handles.append(handle)
            for name in handle.keys():
                self.where[name] = (handle, path)

    def shape(self, name: str) -> tuple[int, ...]:
        handle, _ = self.where[name]
        return tuple(handle.get_slice(name).get_shape())

    def get(self, name: str, expert: int | None = None) -> torch.Tensor:
        """The tensor (or one expert's slice of a fused expert tensor), as stored."""
        handle, path = self.where[name]
        try:
            return handle.get_tensor(name) if expert is None else handle.get_slice(name)[expert]
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"cannot read tensor {name!r} from {path.name}: {exc}") from exc


_EXPERT_PARAMS = ("experts.gate_up_proj", "experts.down_proj", "experts.gate_up_proj_bias", "experts.down_proj_bias")


def _is_experts(pname: str) -> bool:
    return pname.endswith(_EXPERT_PARAMS)


def _on_disk_shape(pname: str, shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    """The checkpoint shape of a fused expert parameter of `shape` ([E, 2I, H], [E, H, I] or a bias)."""
    if layout == "gpt_oss" and len(shape) == 3:
        return (shape[0], shape[2], shape[1])  # stored transposed: [E, H, 2I], [E, I, H]
    return shape


def _from_gpt_oss(gate_up: torch.Tensor, down: torch.Tensor, b_gate_up: torch.Tensor, b_down: torch.Tensor):
    """One GPT-OSS expert as stored (gate_up [H, 2I] columns gate, up, gate, ...; down [I, H]; biases [2I], [H])
    -> (gate_up [2I, H] gate rows first, down [H, I], gate_up bias [2I] gate first, down bias [H])."""
    gate_up = torch.cat((gate_up[:, 0::2], gate_up[:, 1::2]), dim=1).t()  # [2I, H]
    return gate_up, down.t(), torch.cat((b_gate_up[0::2], b_gate_up[1::2])), b_down


class _Layout:
    """Where each slot of the model is in the checkpoint: dense tensors by name, experts per expert or fused."""

    def __init__(self, ckpt: _Checkpoint, cfg: ModelConfig, params: dict[str, tuple[int, ...]],
                 extra_layers: int = 0) -> None:
        self.cfg = cfg
        self.dense: dict[str, str] = {}  # parameter -> checkpoint name
        self.per_expert: dict[str, str] = {}  # "{prefix}.{e}.{part}.weight" -> checkpoint name
        self.fused: dict[str, str] = {}  # expert parameter -> checkpoint name of the fused tensor
        self.mxfp4: dict[str, dict[str, str]] = {}  # expert parameter -> {"blocks": name, "scales": name}
        spec = arch_spec(cfg.arch)
        self.fused_layout = spec.fused_experts
        unexpected = []
        for name in ckpt.where:
            if self.fused_layout == "gpt_oss" and (m := _MXFP4.match(name)) and m.group(1) in params:
                self.mxfp4.setdefault(m.group(1), {})[m.group(2)] = name
                continue
            key, tgt = _target(name, cfg.moe_intermediate_size, spec.renames)
            if tgt.param not in params:
                unexpected.append(name)
            elif tgt.expert is not None:
                self.per_expert[key] = name
            elif _is_experts(tgt.param):
                self.fused[tgt.param] = name
            else:
                self.dense[tgt.param] = name
        check_unexpected(unexpected, cfg, extra_layers)
        missing = []
        for pname in params:
            if cfg.tie_word_embeddings and pname == "lm_head.weight":
                continue
            if not _is_experts(pname):
                if pname not in self.dense:
                    missing.append(pname)
            elif pname in self.mxfp4:
                missing += [f"{pname}_{part}" for part in ("blocks", "scales") if part not in self.mxfp4[pname]]
            elif pname not in self.fused and pname.endswith("_bias"):
                missing.append(pname)  # biased experts are read from the fused layout only
            elif pname not in self.fused:
                prefix = pname.rsplit(".", 1)[0]
                parts = ("gate_proj", "up_proj") if pname.endswith("gate_up_proj") else ("down_proj",)
                missing += [k for e in range(cfg.num_experts) for part in parts
                            if (k := f"{prefix}.{e}.{part}.weight") not in self.per_expert]
        if missing:
            raise MissingTensorError(missing)
        for pname, name in self.dense.items():
            if ckpt.shape(name) != params[pname]:
                raise TensorShapeError(name, params[pname], ckpt.shape(name))
        for pname, name in self.fused.items():
            if ckpt.shape(name) != (want := _on_disk_shape(pname, params[pname], self.fused_layout)):
                raise TensorShapeError(name, want, ckpt.shape(name))
        for pname, names in self.mxfp4.items():  # [E, N, K] in the stack's layout: blocks of 32 along K
            e, n, k = params[pname]
            for part, want in (("blocks", (e, n, -(-k // 32), 16)), ("scales", (e, n, -(-k // 32)))):
                if k % 32 or ckpt.shape(names[part]) != want:
                    raise TensorShapeError(names[part], want, ckpt.shape(names[part]))
        inter, hidden = cfg.moe_intermediate_size, cfg.hidden_size
        for key, name in self.per_expert.items():
            want = (hidden, inter) if key.endswith("down_proj.weight") else (inter, hidden)
            if ckpt.shape(name) != want:
                raise TensorShapeError(name, want, ckpt.shape(name))

    def read_expert(self, ckpt: _Checkpoint, layer: int, e: int) -> tuple[torch.Tensor, ...]:
        """One expert -> (gate_up [2I, H], down [H, I]) in the stored dtype, plus (gate_up bias [2I], down bias
        [H]) for biased experts."""
        prefix = f"model.layers.{layer}.mlp.experts"
        if self.fused_layout == "gpt_oss":
            return _from_gpt_oss(*(self._gpt_oss_tensor(ckpt, f"{prefix}.{p}", e) for p in
                                   ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")))
        if f"{prefix}.gate_up_proj" in self.fused:
            gate_up = ckpt.get(self.fused[f"{prefix}.gate_up_proj"], e)
        else:
            gate_up = torch.cat([ckpt.get(self.per_expert[f"{prefix}.{e}.{p}.weight"]) for p in ("gate_proj", "up_proj")])
        if f"{prefix}.down_proj" in self.fused:
            down = ckpt.get(self.fused[f"{prefix}.down_proj"], e)
        else:
            down = ckpt.get(self.per_expert[f"{prefix}.{e}.down_proj.weight"])
        return gate_up, down


    def _gpt_oss_tensor(self, ckpt: _Checkpoint, pname: str, e: int) -> torch.Tensor:
        """Expert e of a GPT-OSS expert tensor as stored ([H, 2I], [I, H], biases), MXFP4 dequantized."""
        if pname in self.mxfp4:
            blocks, scales = (ckpt.get(self.mxfp4[pname][part], e) for part in ("blocks", "scales"))
            return dequantize_mxfp4(blocks, scales).t()  # [N, K] -> as stored, [K, N]
        return ckpt.get(self.fused[pname], e)


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    progress: bool = True,
    placement: PlacementConfig | None = None,
    pack_workers: int | None = None,
    plan: PlacementPlan | None = None,
    mtp: bool = False,
) -> MoeForCausalLM:
    """Builds the model on the meta device and materialises each parameter as it is read, where the
    placement plan puts it (default: `PlacementPlan.build(config, placement, device)`).

    Dense weights go straight to the fast device in `dtype`. Routed experts: with a `placement`, each
    expert is read, cast to `dtype` and packed into its shards in host memory (`engine.expert_stream`),
    and the model's `Experts.packed` holds them (the raw expert parameters stay empty); without one they
    are materialised at full precision on the fast device (the torch reference path).
    `mtp`: also load the first multi-token-prediction layer (`model.layers.{num_hidden_layers}.*`) as
    `model.mtp` (engine/mtp.py), its routed experts like every layer's; a checkpoint without one is an error.
    """
    model_dir = Path(model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    spec = arch_spec(cfg.arch)
    plan = plan or PlacementPlan.build(cfg, placement, device)
    device = plan.fast_device
    extra = _extra_layers(model_dir)
    with torch.device("meta"):
        model = MoeForCausalLM(cfg).to(dtype)
        ext = _mtp_config(model_dir, cfg, extra) if mtp else None
        layer = MtpLayer(ext).to(dtype) if ext is not None else None
    params = {n: tuple(p.shape) for n, p in model.named_parameters()}
    modules = dict(model.named_modules())
    expert_plans = dict(plan.layers)
    if layer is not None:  # its tensors by their checkpoint names
        prefix = f"model.layers.{cfg.num_layers}"
        params.update({f"{prefix}.{n}": tuple(p.shape) for n, p in layer.named_parameters()})
        modules.update({f"{prefix}.{n}".rstrip("."): m for n, m in layer.named_modules()})
        if plan.layers and layer.is_moe:
            expert_plans[cfg.num_layers] = plan_layers(ext, placement, device)[cfg.num_layers]
        model.mtp = layer
    ckpt = _open_checkpoint(model_dir, cfg)
    layout = _Layout(ckpt, cfg, params, extra)

    def put(pname: str, value: torch.Tensor) -> None:
        owner, _, attr = pname.rpartition(".")
        setattr(modules[owner], attr, nn.Parameter(value, requires_grad=False))

    bar = tqdm(total=len(layout.dense), desc=f"load {model_dir.name} (dense -> {device})", unit="tensor",
               disable=not progress)
    with torch.no_grad():
        for pname, name in layout.dense.items():
            fp32 = pname.endswith(spec.fp32_params)  # as transformers keeps them (DeepSeek's routers)
            value = ckpt.get(name).to(plan.device_for(pname), torch.float32 if fp32 else dtype, copy=True)
            put(pname, value)  # a copy, never a view of the mmap
            bar.update()
        bar.close()
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        moe_layers = [i for i, m in enumerate(cfg.moe_layers) if m]
        if layer is not None:
            share_main_tensors(layer, model)
            moe_layers += [cfg.num_layers] if layer.is_moe else []

        def read(layer: int, e: int) -> tuple[torch.Tensor, ...]:
            # what the full-precision model would hold
            return tuple(t.to(dtype, memory_format=torch.contiguous_format) for t in layout.read_expert(ckpt, layer, e))

        if not plan.layers:
            _materialise_experts(model, cfg, moe_layers, read, device, dtype, progress)
        else:
            _stream_experts(model, cfg, expert_plans, placement, ckpt.files, read, dtype, pack_workers, progress)
            model.expert_reader = read  # a dynamic hot set packs swapped experts from the checkpoint again
    model.eval()
    return model


def _open_checkpoint(model_dir: Path, cfg: ModelConfig):
    """safetensors (block-FP8 dequantized on read where config.json says so) or a GGUF file."""
    gguf_file = find_gguf(model_dir)
    if gguf_file is not None:
        return GgufCheckpoint(gguf_file, cfg.arch, cfg.num_heads, cfg.num_kv_heads)
    ckpt = _Checkpoint(model_dir)
    return BlockFp8Checkpoint(ckpt, cfg.quantization) if cfg.quantization is not None else ckpt


def _extra_layers(model_dir: Path) -> int:
    """Layers stored past num_hidden_layers that decoding never runs (multi-token prediction)."""
    config = model_dir / "config.json"
    hf = json.loads(config.read_text()) if config.is_file() and model_dir.is_dir() else {}
    return int(hf.get("num_nextn_predict_layers") or 0)


def _mtp_config(model_dir: Path, cfg: ModelConfig, extra: int) -> ModelConfig:
    if cfg.arch == "qwen3_next":
        raise CheckpointError("Qwen3-Next's multi-token-prediction module (mtp.*) is not a draft source here (its "
                              "recurrent state cannot roll back drafts either); use speculative_source ngram")
    if not extra or find_gguf(model_dir) is not None:
        raise CheckpointError(f"{model_dir} has no multi-token-prediction layer (config.json's num_nextn_predict_layers "
                              "is 0 or absent, or a GGUF file): MTP drafts need a safetensors checkpoint that ships "
                              "one (DeepSeek-V3, GLM-4.5); use speculative_source ngram")
    return mtp_config(read_hf_config(model_dir), cfg)


def _layer(model: MoeForCausalLM, i: int) -> nn.Module:
    """Decoder layer i, or the MTP layer stored right after the stack."""
    return model.model.layers[i] if i < len(model.model.layers) else model.mtp


def _materialise_experts(model, cfg, moe_layers, read, device, dtype, progress) -> None:
    e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    for layer in tqdm(moe_layers, desc="load experts (full precision)", unit="layer", disable=not progress):
        experts = _layer(model, layer).mlp.experts
        gate_up = torch.empty(e, 2 * i, h, dtype=dtype, device=device)
        down = torch.empty(e, h, i, dtype=dtype, device=device)
        biases = (torch.empty(e, 2 * i, dtype=dtype, device=device), torch.empty(e, h, dtype=dtype, device=device))
        for x in range(e):
            gu, dn, *bias = read(layer, x)
            gate_up[x].copy_(gu)
            down[x].copy_(dn)
            for dst, src in zip(biases, bias, strict=False):
                dst[x].copy_(src)
        experts.gate_up_proj = nn.Parameter(gate_up, requires_grad=False)
        experts.down_proj = nn.Parameter(down, requires_grad=False)
        if cfg.expert_bias:
            experts.gate_up_proj_bias = nn.Parameter(biases[0], requires_grad=False)
            experts.down_proj_bias = nn.Parameter(biases[1], requires_grad=False)


def _stream_experts(model, cfg, plans, placement, files, read, dtype, workers, progress) -> None:
    from engine.expert_stream import stream_experts

    cache_dir = placement.pack_cache_dir if placement is not None else None
    # the cache key names the checkpoint files and the dtype the experts were rounded to before packing
    source = ";".join(file_identity(p) for p in files) + f";{dtype}"
    act = _layer(model, next(iter(plans))).mlp.experts.act  # the experts' activation, packed with them
    layers = stream_experts(read, plans, cfg.hidden_size, cfg.moe_intermediate_size, cache_dir=cache_dir,
                            source=source, workers=workers, progress=progress, act=act)
    for i, le in layers.items():
        experts = _layer(model, i).mlp.experts
        experts.packed = le
        for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
            if hasattr(experts, name):
                setattr(experts, name, nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False))
