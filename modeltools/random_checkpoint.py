"""Random-weight MoE checkpoints in Hugging Face layout (safetensors + config + tokenizer) for tests and benchmarks."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from engine.archs import ARCHS as REGISTRY
from engine.errors import CheckpointError
from modeltools.bpe_vocab import small_bpe_tokenizer_json
from modeltools.qwen_vocab import QWEN_CONFIG_VOCAB_SIZE, qwen_tokenizer_json

ARCHS = tuple(REGISTRY)  # every family of engine/archs.py (aliases such as kimi_k2 share a family's checkpoints)
VOCABS = ("bpe", "qwen")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PROGRESS_PARAMS = 50_000_000  # show progress above this many parameters

class RandomCheckpointError(ValueError):
    """Inconsistent options for a random checkpoint."""


def chatml_template() -> str:
    """The ChatML + tools template every random checkpoint ships (Qwen2.5/Qwen3 tool-call format)."""
    return (resources.files("engine.chat_templates") / "chatml_tools.jinja").read_text(encoding="utf-8")


@dataclass(frozen=True)
class VocabFiles:
    tokenizer_json: str
    added_tokens: tuple[dict[str, Any], ...]  # tokenizer.json's added_tokens entries
    tokenizer_size: int  # ids incl. added tokens
    config_vocab_size: int  # embedding rows
    endoftext_id: int
    im_end_id: int


def vocab_files(vocab: str) -> VocabFiles:
    if vocab == "qwen":
        text, config_size = qwen_tokenizer_json(), QWEN_CONFIG_VOCAB_SIZE
    elif vocab == "bpe":
        text, config_size = small_bpe_tokenizer_json(), None
    else:
        raise RandomCheckpointError(f"vocab must be one of {VOCABS}, got {vocab!r}")
    data = json.loads(text)
    added = {t["content"]: t["id"] for t in data["added_tokens"]}
    size = max(max(added.values()), max(data["model"]["vocab"].values())) + 1
    if config_size is None:
        config_size = math.ceil(size / 64) * 64
    return VocabFiles(text, tuple(data["added_tokens"]), size, config_size, added["<|endoftext|>"], added["<|im_end|>"])


def tokenizer_config(v: VocabFiles, max_length: int) -> dict[str, Any]:
    added = {
        str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
        for t in v.added_tokens
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [t["content"] for t in v.added_tokens if t["special"]][1:],
        "bos_token": None,
        "chat_template": chatml_template(),
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": max_length,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def write_tokenizer_files(out_dir: str | Path, vocab: str = "bpe", max_length: int = 32768) -> VocabFiles:
    """tokenizer.json + tokenizer_config.json (ChatML tools template) for `vocab` into `out_dir`."""
    v = vocab_files(vocab)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(v.tokenizer_json, encoding="utf-8")
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(v, max_length), indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    return v


def _arch_config_kwargs(arch: str, *, hidden_size: int, num_layers: int, num_experts: int, top_k: int,
                        moe_intermediate_size: int, num_heads: int, num_kv_heads: int, head_dim: int | None,
                        options: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 config kwargs (the registry's random_config); `options` (extra arch fields) override them."""
    kw: dict[str, Any] = dict(hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
                              num_key_value_heads=num_kv_heads, num_experts_per_tok=top_k, num_experts=num_experts,
                              moe_intermediate_size=moe_intermediate_size)
    if head_dim is not None:
        kw["head_dim"] = head_dim
    try:
        kw = REGISTRY[arch].random_config(kw)
    except CheckpointError as exc:
        raise RandomCheckpointError(str(exc)) from exc
    options = dict(options)
    if "rope_theta" in options:  # transformers 5 keeps it under rope_parameters
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": float(options.pop("rope_theta"))}
    kw.update(options)
    return kw


def estimate_params(vocab_rows: int, hidden_size: int, num_layers: int, num_experts: int,
                    moe_intermediate_size: int, num_heads: int, num_kv_heads: int, head_dim: int | None) -> int:
    hd = head_dim or hidden_size // num_heads
    attn = hidden_size * hd * (2 * num_heads + 2 * num_kv_heads)
    experts = num_experts * 3 * hidden_size * moe_intermediate_size
    return 2 * vocab_rows * hidden_size + num_layers * (attn + experts + num_experts * hidden_size)


def _random_model(model_cls: Any, config: Any, seed: int) -> torch.nn.Module:
    """transformers' own initialisation under `seed`, then norms and biases perturbed away from 1 / 0 and
    DeepSeek-V3's score-correction bias made to steer, so that a loader mixing them up is caught."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.ndim == 1 or name.endswith("_bias"):  # norms (ones), biases (zeros; GPT-OSS's expert
                    base = 1.0 if name.endswith("norm.weight") else 0.0  # biases are [E, N]): distinguishable
                    p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):  # a saved buffer (DeepSeek-V3): make it steer
                    b.copy_(0.05 * torch.randn(b.shape, generator=gen))
    return model


def write_random_checkpoint(
    out_dir: str | Path,
    arch: str = "qwen3_moe",
    *,
    hidden_size: int,
    num_layers: int,
    num_experts: int,
    top_k: int,
    moe_intermediate_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int | None = None,
    vocab: str = "bpe",
    seed: int = 0,
    dtype: str = "float32",
    max_position_embeddings: int = 32768,
    progress: bool | None = None,
    **arch_options: Any,
) -> Path:
    """Build `arch` with random weights (seeded) via transformers and save it HF-style into `out_dir`.

    `arch_options` are extra config fields (e.g. norm_topk_prob, mlp_only_layers, decoder_sparse_step,
    shared_expert_intermediate_size, qkv_bias, attention_bias, rope_theta, rms_norm_eps, tie_word_embeddings).
    Norm weights and biases are perturbed away from 1/0 so that a loader mixing them up is caught.
    """
    import transformers
    from transformers import GenerationConfig

    if arch not in ARCHS:
        raise RandomCheckpointError(f"arch must be one of {ARCHS}, got {arch!r}")
    if dtype not in DTYPES:
        raise RandomCheckpointError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    if not 0 < top_k <= num_experts:
        raise RandomCheckpointError(f"top_k={top_k} must be in 1..num_experts={num_experts}")
    if num_heads % num_kv_heads:
        raise RandomCheckpointError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    if head_dim is None and hidden_size % num_heads:
        raise RandomCheckpointError(f"hidden_size={hidden_size} is not divisible by num_heads={num_heads}; pass head_dim")
    out = Path(out_dir)
    v = vocab_files(vocab)
    n_params = estimate_params(v.config_vocab_size, hidden_size, num_layers, num_experts, moe_intermediate_size,
                               num_heads, num_kv_heads, head_dim)
    show = progress if progress is not None else n_params >= _PROGRESS_PARAMS
    steps = tqdm(total=4, desc=f"random {arch} ({n_params / 1e6:.0f}M params)", disable=not show, unit="step")

    kw = _arch_config_kwargs(arch, hidden_size=hidden_size, num_layers=num_layers, num_experts=num_experts,
                             top_k=top_k, moe_intermediate_size=moe_intermediate_size, num_heads=num_heads,
                             num_kv_heads=num_kv_heads, head_dim=head_dim, options=arch_options)
    config_cls, model_cls = (getattr(transformers, name) for name in REGISTRY[arch].hf_classes)
    known = set(config_cls().to_dict()) | set(config_cls.attribute_map) | {"head_dim", "rope_theta"}
    unknown = sorted(set(arch_options) - known)
    if unknown:  # transformers would silently keep them as unused attributes
        raise RandomCheckpointError(f"{config_cls.__name__} has no field(s) {unknown}")
    config = config_cls(
        vocab_size=v.config_vocab_size, max_position_embeddings=max_position_embeddings,
        bos_token_id=v.endoftext_id, eos_token_id=v.im_end_id, pad_token_id=None, **kw,
    )

    steps.set_postfix_str("init")
    model = _random_model(model_cls, config, seed)
    steps.update()
    model = model.to(DTYPES[dtype])
    model.generation_config = GenerationConfig(
        bos_token_id=v.endoftext_id, eos_token_id=[v.im_end_id, v.endoftext_id], pad_token_id=v.endoftext_id,
    )
    steps.update()
    steps.set_postfix_str("save")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    steps.update()
    write_tokenizer_files(out, vocab, max_position_embeddings)
    steps.update()
    steps.close()
    return out
