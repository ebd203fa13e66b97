"""DeepSeek-V3's multi-token-prediction layer as a draft source (engine/mtp.py): loaded only when asked for, its
logits against a plain-torch reference written from the module's definition (transformers' decoder layer for
the block, vLLM's DeepSeekMultiTokenPredictorLayer for the wrapper), and output unchanged by its drafts."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine.errors import CheckpointError
from engine.experts import PlacementConfig
from engine.forward_batch import ForwardBatch
from engine.llm_engine import LLM, EngineConfig, LLMEngine
from engine.loader import load_model
from engine.sampling_params import SamplingParams
from modeltools.mtp_checkpoint import FILE, add_mtp_layer
from policies.model import DecodingSettings
from tests.engine.conftest import run_requests

PACKED = PlacementConfig(fast_format="fp32", exact_format="fp32")


@pytest.fixture(scope="module")
def mtp_checkpoint(hf_checkpoint, tmp_path_factory):
    def make(mirror: bool = False, arch: str = "deepseek_v3"):
        path = tmp_path_factory.mktemp(f"{arch}-{'mirror' if mirror else 'mtp'}")
        shutil.copytree(hf_checkpoint(arch), path, dirs_exist_ok=True)
        add_mtp_layer(path, seed=3, mirror=mirror)
        return path

    return make


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 500, (int(torch.randint(3, 25, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _reference_logits(path, tmp_path, tokens: list[int]) -> torch.Tensor:
    """Logits for t_{i+2} at every position i < len(tokens) - 1: the main model's final hidden state h_i (after its
    final norm) and t_{i+1} through enorm / hnorm / eh_proj, transformers' DeepSeek-V3 decoder layer as layer L of
    an (L+1)-layer model, then shared_head's norm and head."""
    cfg = json.loads((path / "config.json").read_text())
    L, eps = cfg["num_hidden_layers"], cfg["rms_norm_eps"]
    main = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    mtp = load_file(path / FILE)
    p = {n.removeprefix(f"model.layers.{L}."): t for n, t in mtp.items()}
    ext = tmp_path / "ext"  # the block as layer L of a model one layer longer
    ext.mkdir()
    shutil.copy(path / "config.json", ext / "config.json")
    c = json.loads((ext / "config.json").read_text())
    c["num_hidden_layers"] = L + 1
    (ext / "config.json").write_text(json.dumps(c))
    own = ("embed_tokens", "enorm", "hnorm", "eh_proj", "shared_head")
    block = {n: t for n, t in mtp.items() if n.split(".")[3] not in own}
    save_file({**load_file(path / "model.safetensors"), **block}, ext / "model.safetensors")
    longer = AutoModelForCausalLM.from_pretrained(ext, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.tensor([tokens])
    with torch.no_grad():
        h = main.model(ids).last_hidden_state[0, :-1]  # [T-1, H] after the final norm
        nxt = torch.tensor(tokens[1:])
        e = p["embed_tokens.weight"][nxt]
        pos = torch.arange(len(tokens) - 1)
        e[pos == 0] = 0.0
        x = torch.cat((_rms(e, p["enorm.weight"], eps), _rms(h, p["hnorm.weight"], eps)), -1) @ p["eh_proj.weight"].T
        x = x[None]
        cos_sin = longer.model.rotary_emb(x, pos[None])
        t = x.shape[1]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        y = longer.model.layers[L](x, attention_mask=mask, position_ids=pos[None], position_embeddings=cos_sin)
        y = y[0] if isinstance(y, tuple) else y
        return _rms(y[0], p["shared_head.norm.weight"], eps) @ p["shared_head.head.weight"].T


def test_mtp_logits_match_the_reference_module(mtp_checkpoint, tmp_path):
    path = mtp_checkpoint()
    tokens = _prompts(1, 4)[0] + [7, 9, 11]
    want = _reference_logits(path, tmp_path, tokens)
    main = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for placement in (None, PACKED):
        model = load_model(path, progress=False, mtp=True, placement=placement)
        layer = model.mtp
        assert layer.embed_tokens.weight is model.model.embed_tokens.weight  # equal copies are not duplicated
        assert layer.main_logits is not None
        t = len(tokens) - 1
        cache = (torch.zeros(t, 1, layer.self_attn.cfg.kv_lora_rank + layer.self_attn.cfg.qk_rope_head_dim),)
        batch = ForwardBatch(input_ids=torch.empty(0, dtype=torch.long), positions=torch.arange(t),
                             slot_mapping=torch.arange(t), query_lens=[t], context_lens=[t],
                             context_slots=[torch.arange(t)], logits_rows=torch.empty(0, dtype=torch.long))
        with torch.no_grad():
            h = main.model(torch.tensor([tokens])).last_hidden_state[0, :-1]
            got = layer.logits(layer.hidden(torch.tensor(tokens[1:]), h, batch, cache))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_first_mtp_draft_is_the_reference_argmax(mtp_checkpoint, tmp_path):
    """Through the engine: the main model's hidden states of the prompt and the sampled token feed the layer."""
    path = mtp_checkpoint()
    prompt = _prompts(1, 9)[0]
    engine = LLMEngine(EngineConfig(str(path), num_kv_blocks=32, block_size=4, progress=False, speculative_tokens=1,
                                    speculative_source="mtp"))
    engine.add_request("a", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()  # the prefill: one token sampled, one draft for the next step
    seq = engine._seqs["a"]
    want = _reference_logits(path, tmp_path, prompt + seq.output_token_ids)[-1]
    assert seq.draft_token_ids == [int(want.argmax())]


def test_mtp_cache_after_rejected_drafts_is_the_full_sequence_reference(mtp_checkpoint, tmp_path):
    """A random layer's drafts are nearly all rejected: after steps of rolled-back drafts, prefill chunks and a
    packed MoE, the next draft is still the reference module's argmax over the whole sequence (its cache holds
    every kept position once, none of the rejected ones)."""
    path = mtp_checkpoint()
    prompt = _prompts(1, 31)[0] + [5, 6, 7, 8, 9, 10]
    engine = LLMEngine(EngineConfig(str(path), num_kv_blocks=32, block_size=4, max_num_batched_tokens=8,
                                    progress=False, placement=PACKED, speculative_tokens=1, speculative_source="mtp"))
    engine.add_request("a", prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(12):
        engine.step()
    seq = engine._seqs["a"]
    assert engine.decoder.stats.drafted_tokens > engine.decoder.stats.accepted_tokens  # rollbacks happened
    want = _reference_logits(path, tmp_path, prompt + seq.output_token_ids)[-1]
    assert seq.draft_token_ids == [int(want.argmax())]


@pytest.mark.parametrize(("arch", "placement"), [("deepseek_v3", None), ("deepseek_v3", PACKED), ("glm4_moe", PACKED)],
                         ids=["deepseek-torch", "deepseek-packed", "glm-packed"])
def test_output_with_mtp_drafts_equals_output_without(mtp_checkpoint, arch, placement):
    """Greedy, token for token in both modes and with 1 or 3 chained drafts; seeded execution never drafts (it
    must draw the same random numbers whatever the settings), so it is unchanged too. GLM-4.5's grouped-query
    attention runs the fused one-call step, whose rows' hidden states the layer reads."""
    path = mtp_checkpoint(mirror=True, arch=arch)  # drafts the main model often agrees with: some kept, some not
    args = dict(num_kv_blocks=96, block_size=4, max_num_batched_tokens=16, progress=False, placement=placement)
    prompts = _prompts(3, 2)
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, seed=7)
    requests = [(f"{mode}{i}", p, greedy, mode) for mode in ("exploration", "execution")
                for i, p in enumerate(prompts)] + [(f"s{i}", p, seeded, "execution") for i, p in enumerate(prompts)]
    want = run_requests(LLMEngine(EngineConfig(str(path), **args)), requests)
    for k in (1, 3):
        engine = LLMEngine(EngineConfig(str(path), speculative_tokens=k, speculative_source="mtp", **args))
        assert run_requests(engine, requests) == want
        stats = engine.decoder.stats
        assert 0 < stats.accepted_tokens < stats.drafted_tokens


def test_seeded_exploration_drafts_through_the_verified_path(mtp_checkpoint):
    """Sampling keeps the target distribution (test_engine_multi_token), not the undrafted run's tokens: here the
    drafts are verified and the output is a full-length sample."""
    path = mtp_checkpoint(mirror=True)
    llm = LLM(path, num_kv_blocks=64, block_size=4, progress=False, speculative_tokens=2, speculative_source="mtp")
    out = llm.generate(_prompts(2, 5), SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.7, seed=3))
    assert [len(o.token_ids) for o in out] == [16, 16]
    assert llm.engine.decoder.stats.drafted_tokens > 0


def test_prefix_cache_hit_still_drafts_and_stays_exact(mtp_checkpoint):
    path = mtp_checkpoint(mirror=True)
    prompt = _prompts(1, 21)[0] * 3
    args = dict(num_kv_blocks=64, block_size=4, max_num_batched_tokens=16, progress=False)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = LLM(path, prefix_cache=False, **args).generate([prompt], params)[0].token_ids
    engine = LLMEngine(EngineConfig(str(path), speculative_tokens=2, speculative_source="mtp", **args))
    for rid in ("a", "b"):  # b's prompt blocks come from the cache: its layer cache starts after them
        assert run_requests(engine, [(rid, prompt, params, "exploration")])[rid] == want
    assert engine.decoder.stats.accepted_tokens > 0


def test_mtp_layers_load_only_when_asked_for(mtp_checkpoint, hf_checkpoint):
    path = mtp_checkpoint()
    assert load_model(path, progress=False).mtp is None  # skipped as unused
    with pytest.raises(CheckpointError, match="no multi-token-prediction layer"):
        LLMEngine(EngineConfig(str(hf_checkpoint("qwen3_moe")), speculative_tokens=1, speculative_source="mtp",
                               num_kv_blocks=16, progress=False))
    with pytest.raises(ValueError, match="draft_source"):
        EngineConfig(str(path), speculative_tokens=1, speculative_source="eagle")
    with pytest.raises(ValidationError, match="speculative_source"):
        DecodingSettings(speculative_tokens=1, speculative_source="eagle")
    assert DecodingSettings(speculative_tokens=1, speculative_source="mtp").speculative_source == "mtp"


def test_runner_keeps_the_same_hidden_states_on_the_one_call_step(hf_checkpoint, monkeypatch):
    """The hidden states the layer reads: the fused one-call step's rows (decodes, and short prefill chunks whose
    rows the lm_head's input compacts) equal the batch forward's, step by step."""
    from engine.models.fused_step import FusedDecodeStep

    path = hf_checkpoint("qwen3_moe")
    args = dict(num_kv_blocks=64, block_size=4, max_num_batched_tokens=8, progress=False, placement=PACKED)
    requests = [(f"r{i}", p, SamplingParams(max_tokens=6, ignore_eos=True), "execution")
                for i, p in enumerate(_prompts(2, 13))]
    calls, step = [], FusedDecodeStep.__call__
    monkeypatch.setattr(FusedDecodeStep, "__call__", lambda self, *a: calls.append(1) or step(self, *a))
    kept = {}
    for fused in (True, False):
        engine = LLMEngine(EngineConfig(str(path), **args))
        engine.runner.keep_hidden = True
        if not fused:
            engine.runner._decode_step = lambda chunks: None  # every step on the batch forward
        for rid, prompt, params, mode in requests:
            engine.add_request(rid, prompt, params, mode=mode)
        kept[fused] = []
        while engine.has_work():
            engine.step()
            kept[fused].append([h.clone() for h in engine.runner.hidden])
        assert bool(calls) == fused
        calls.clear()
    assert len(kept[True]) == len(kept[False])
    for a, b in zip(kept[True], kept[False], strict=True):
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
