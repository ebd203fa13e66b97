"""Qwen3-Next: gated DeltaNet linear-attention layers with a recurrent state per sequence, beside gated full
attention. fp32 logits and greedy tokens of one prompt: test_engine_parity. Here: greedy tokens equal to
transformers.generate (fp32) for prompts of different lengths served concurrently, chunked prefill, abort,
preemption and prefix-cache hits (a hit restores the recurrent state saved at its boundary, or is refused),
and quantized experts within the drift bounds of the other families.

The tiny checkpoint (tests/engine/conftest.py): 4 layers linear / full / linear (dense MLP) / linear, 2 key heads
serving 6 value heads, conv kernel 4, head_dim 24 with a quarter rotary. Quantized experts (teacher-forced along
the fp32 model's greedy tokens, 4 prompts x 12 steps): int8 within mean KL 0.01 nats and top-1 equal on >= 90%
of steps; int4 within mean KL 0.05 and >= 75% (the bounds of test_engine_deepseek and test_engine_gpt_oss).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import ModelConfig
from engine.experts import PlacementConfig
from engine.kv_cache import KVCacheSpec
from engine.llm_engine import LLM
from engine.loader import load_model
from engine.mode import Mode
from engine.sampling_params import SamplingParams
from tests.engine.conftest import drift, run_requests, teacher_forced_rows

STEPS = 12
ARGS = dict(num_kv_blocks=64, block_size=8, progress=False)


def _prompts(n: int, seed: int, lengths=(1, 45)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 500, (int(torch.randint(*lengths, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.fixture(scope="module")
def reference():
    """transformers' greedy continuation of a prompt, memoised: prompt tuple -> STEPS tokens."""
    models, memo = {}, {}

    def tokens(path, prompt: list[int], steps: int = STEPS) -> list[int]:
        key = (str(path), tuple(prompt), steps)
        if key not in memo:
            if path not in models:
                models[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            out = models[path].generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False,
                                        eos_token_id=None, pad_token_id=0)
            memo[key] = out[0, len(prompt):].tolist()
        return memo[key]

    return tokens


def _params(steps: int = STEPS) -> SamplingParams:
    return SamplingParams(max_tokens=steps, ignore_eos=True)


def test_config_modules_and_caches_follow_layer_types(hf_checkpoint):
    path = hf_checkpoint("qwen3_next")
    cfg = ModelConfig.from_dir(path)
    assert cfg.kv_layers == (1,) and cfg.linear_layers == (0, 2, 3) and cfg.rotary_dim == 6
    assert cfg.linear_attention.conv_dim == 2 * 2 * 12 + 6 * 10
    model = load_model(path, progress=False)
    assert [layer.mixer_name for layer in model.model.layers] == ["linear_attn", "self_attn", "linear_attn",
                                                                  "linear_attn"]
    assert model.model.layers[0].linear_attn.A_log.abs().sum() > 0  # loaded, not left at its init
    # only the full-attention layer holds KV: a quarter of what four attention layers would
    assert KVCacheSpec.bytes_per_block(cfg, 8, torch.float32) == 2 * 1 * 2 * 24 * 4 * 8


@pytest.mark.parametrize("n", [1, 5, 64, 150])
def test_chunked_delta_rule_equals_the_recurrent_one(n):
    """The chunked form (prefill, blocks of 64 with padding) against the token-by-token recurrence, from a state."""
    from engine.models.qwen3_next import chunk_gated_delta_rule, l2norm, recurrent_gated_delta_rule

    g = torch.Generator().manual_seed(n)
    q, k = (l2norm(torch.randn(3, n, 12, generator=g, dtype=torch.float64)) for _ in range(2))
    v = torch.randn(3, n, 10, generator=g, dtype=torch.float64)
    decay, beta = -torch.rand(3, n, generator=g, dtype=torch.float64), torch.rand(3, n, generator=g, dtype=torch.float64)
    state = torch.randn(3, 12, 10, generator=g, dtype=torch.float64)
    want, want_state = recurrent_gated_delta_rule(q, k, v, decay, beta, state)
    got, got_state = chunk_gated_delta_rule(q, k, v, decay, beta, state)
    assert torch.allclose(got, want, atol=1e-10) and torch.allclose(got_state, want_state, atol=1e-10)


def test_state_slots_and_snapshot_lru(hf_checkpoint):
    from engine.recurrent_state import RecurrentStates
    from engine.sequence import Sequence

    cfg = ModelConfig.from_dir(hf_checkpoint("qwen3_next"))
    states = RecurrentStates(cfg, max_seqs=2, snapshots=1, block_size=4, device="cpu")
    a, b = (Sequence(i, [1] * 9, _params()) for i in "ab")
    states.admit(a)
    states.admit(b)
    with pytest.raises(RuntimeError, match="max_num_seqs"):
        states.admit(Sequence("c", [1], _params()))
    conv, delta = states.layers[0]
    delta[a.state_slot].fill_(1.0)
    states.save(a, "h0")
    delta[b.state_slot].fill_(2.0)
    states.save(b, "h1")  # one snapshot slot: a's is evicted
    assert states.longest_hit(["h0", "h1"], 2, 1) == 2 and states.longest_hit(["h0", "x"], 2, 1) == 0
    slot_a = a.state_slot
    states.release(a)
    assert a.state_slot is None
    fresh = Sequence("d", [1] * 9, _params(), num_computed=8, block_hashes=["h0", "h1"])
    states.admit(fresh)  # a prefix hit of 2 blocks restores the snapshot at their end, in the slot a gave back
    assert fresh.state_slot == slot_a
    assert torch.equal(delta[fresh.state_slot], torch.full_like(delta[0], 2.0))


def test_mtp_tensors_are_known_unused_and_others_are_errors(hf_checkpoint, tmp_path):
    """The released checkpoints carry a multi-token-prediction module (`mtp.*`) that decoding never runs."""
    import shutil

    from safetensors.torch import load_file, save_file

    from engine.errors import UnexpectedTensorError

    src = hf_checkpoint("qwen3_next")
    shutil.copytree(src, tmp_path / "ok")
    tensors = load_file(str(src / "model.safetensors"))
    save_file({**tensors, "mtp.fc.weight": torch.zeros(64, 128)}, str(tmp_path / "ok" / "model.safetensors"))
    load_model(tmp_path / "ok", progress=False)
    shutil.copytree(src, tmp_path / "bad")
    save_file({**tensors, "model.layers.0.linear_attn.extra.weight": torch.zeros(2)},
              str(tmp_path / "bad" / "model.safetensors"))
    with pytest.raises(UnexpectedTensorError, match="linear_attn.extra"):
        load_model(tmp_path / "bad", progress=False)


def test_concurrent_prompts_of_different_lengths_match_transformers(hf_checkpoint, reference):
    """One forward holds prefills and decodes of several sequences, each with its own state slot."""
    path = hf_checkpoint("qwen3_next")
    prompts = _prompts(5, 1)
    llm = LLM(path, **ARGS)
    outs = llm.generate(prompts, _params())
    assert [o.token_ids for o in outs] == [reference(path, p) for p in prompts]


def test_chunked_prefill_carries_the_state_across_chunks(hf_checkpoint, reference):
    path = hf_checkpoint("qwen3_next")
    prompts = [_prompts(1, 2, (60, 61))[0], _prompts(1, 3, (37, 38))[0]]
    llm = LLM(path, max_num_batched_tokens=16, **ARGS)  # 60 tokens: four chunks, each starting from the last state
    outs = llm.generate(prompts, _params())
    assert [o.token_ids for o in outs] == [reference(path, p) for p in prompts]


def test_abort_mid_stream_then_new_requests(hf_checkpoint, reference):
    path = hf_checkpoint("qwen3_next")
    engine = LLM(path, max_num_seqs=3, max_num_batched_tokens=16, prefix_cache=False, **ARGS).engine
    states = engine.runner.states
    first = _prompts(3, 4, (20, 40))
    for i, p in enumerate(first):
        engine.add_request(f"a{i}", p, _params(), mode=Mode.EXPLORATION)
    for _ in range(4):  # the first prompt decoding, the others waiting or part-way through their prefill
        engine.step()
    assert engine._seqs["a0"].state_slot is not None and engine._seqs["a0"].output_token_ids
    engine.abort("a0")
    engine.abort("a2")
    assert len(states._free) == 3 - sum(s.state_slot is not None for s in engine._seqs.values())  # slots came back
    later = _prompts(3, 5)
    done = run_requests(engine, [(f"b{i}", p, _params(), Mode.EXPLORATION) for i, p in enumerate(later)])
    assert [done[f"b{i}"] for i in range(3)] == [reference(path, p) for p in later]
    assert done["a1"] == reference(path, first[1])
    assert sorted(states._free) == [0, 1, 2]


def test_preempted_sequences_are_recomputed(hf_checkpoint, reference):
    path = hf_checkpoint("qwen3_next")
    prompts = _prompts(4, 6, (25, 40))
    llm = LLM(path, num_kv_blocks=14, block_size=8, max_num_batched_tokens=32, prefix_cache=False, progress=False)
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, _params())
    seqs = list(engine._seqs.values())
    done = run_requests(engine, [])
    assert sum(s.num_preemptions for s in seqs) > 0  # 14 blocks of 8 cannot hold four ~50-token sequences
    assert [done[str(i)] for i in range(4)] == [reference(path, p) for p in prompts]
    assert engine.scheduler.blocks.num_free == 14 and sorted(engine.runner.states._free) == list(range(32))


def test_prefix_cache_hit_restores_the_state_and_equals_a_miss(hf_checkpoint, reference):
    path = hf_checkpoint("qwen3_next")
    prompt = _prompts(1, 7, (43, 44))[0]
    engine = LLM(path, max_num_batched_tokens=16, **ARGS).engine
    cold = run_requests(engine, [("cold", prompt, _params(), Mode.EXPLORATION)])["cold"]
    assert cold == reference(path, prompt)
    engine.add_request("hit", prompt, _params())
    engine.step()
    seq = engine._seqs["hit"]
    assert seq.num_cached_tokens == 40  # the prompt's last full block, where the cold run's state was saved
    done = run_requests(engine, [])
    assert done["hit"] == cold
    # a follow-up turn: the prompt, the reply and more tokens hit at a block its decode ended on
    follow = prompt + cold + _prompts(1, 8, (9, 10))[0]
    engine.add_request("turn", follow, _params())
    engine.step()
    assert engine._seqs["turn"].num_cached_tokens == 48
    assert run_requests(engine, [])["turn"] == reference(path, follow)


def test_execution_mode_reuses_whole_chunks_with_their_state(hf_checkpoint, reference):
    """Execution requests run alone in aligned chunks and reuse only whole chunks: their state is saved at each."""
    path = hf_checkpoint("qwen3_next")
    prompt = _prompts(1, 9, (43, 44))[0]
    engine = LLM(path, max_num_batched_tokens=16, **ARGS).engine
    cold = run_requests(engine, [("cold", prompt, _params(), Mode.EXECUTION)])["cold"]
    assert cold == reference(path, prompt)
    engine.add_request("hit", prompt, _params(), mode=Mode.EXECUTION)
    engine.step()
    assert engine._seqs["hit"].num_cached_tokens == 32
    assert run_requests(engine, [])["hit"] == cold


def test_prefix_hit_without_a_state_snapshot_is_refused(hf_checkpoint, reference):
    path = hf_checkpoint("qwen3_next")
    prompt = _prompts(1, 7, (43, 44))[0]
    engine = LLM(path, max_num_batched_tokens=16, state_snapshots=0, **ARGS).engine
    run_requests(engine, [("cold", prompt, _params(), Mode.EXPLORATION)])
    assert engine.blocks.num_hashed > 0  # the KV blocks are cached ...
    engine.add_request("again", prompt, _params())
    engine.step()
    assert engine._seqs["again"].num_cached_tokens == 0  # ... but with no state at their end, no hit
    assert run_requests(engine, [])["again"] == reference(path, prompt)


@pytest.mark.parametrize(("fmt", "kl_bound", "top1_bound"), [("int8", 0.01, 0.9), ("int4", 0.05, 0.75)])
def test_quantized_experts_within_drift_bounds(hf_checkpoint, fmt, kl_bound, top1_bound):
    path = hf_checkpoint("qwen3_next")
    prompts = _prompts(4, 31, (17, 40))
    exact = LLM(path, **ARGS)
    reference = [o.token_ids for o in exact.generate(prompts, _params())]
    base = teacher_forced_rows(exact, prompts, reference)
    quant = LLM(path, placement=PlacementConfig(fast_format=fmt, exact_format=fmt), **ARGS)
    rows = teacher_forced_rows(quant, prompts, reference)
    kl, top1 = drift(rows, base)
    assert 0 < kl <= kl_bound  # > 0: the quantized experts really ran
    assert top1 >= top1_bound


def test_fast_dense_packs_both_mixers_within_drift_bounds(hf_checkpoint):
    """Exploration's int8 projections (`fast_dense`): gated attention's [q|gate; k; v] and o, DeltaNet's
    [qkvz; ba] and out_proj, within the int8 expert bounds of the fp32 model."""
    path = hf_checkpoint("qwen3_next")
    prompts = _prompts(4, 32, (17, 40))
    exact = LLM(path, **ARGS)
    reference = [o.token_ids for o in exact.generate(prompts, _params())]
    base = teacher_forced_rows(exact, prompts, reference)
    fast = LLM(path, fast_dense="int8", **ARGS)
    assert all(layer.mixer.fast_qkv is not None and layer.mixer.fast_o is not None
               for layer in fast.engine.runner.model.model.layers)
    rows = teacher_forced_rows(fast, prompts, reference)
    kl, top1 = drift(rows, base)
    assert 0 < kl <= 0.01
    assert top1 >= 0.9


def test_speculation_is_off_where_drafts_cannot_be_rolled_back(hf_checkpoint, reference, caplog):
    """Rejected drafts would stay in the recurrent state: a Qwen3-Next engine asked to speculate says so and
    decodes one token a step, equal to transformers on a repetitive prompt (where drafts would be proposed)."""
    path = hf_checkpoint("qwen3_next")
    prompt = [7, 8, 9, 10] * 6
    with caplog.at_level("WARNING", logger="engine.multi_token"):
        llm = LLM(path, speculative_tokens=4, **ARGS)
    assert "speculative decoding is off" in caplog.text
    assert llm.generate([prompt], _params())[0].token_ids == reference(path, prompt)
    assert llm.engine.decoder.stats.drafted_tokens == 0
