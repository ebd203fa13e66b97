"""Batched execution: execution chunks share one forward on the fused execution path and keep their bytes.

A token's row there is computed in an order fixed by the row alone (engine/models/fused_decode.py), so
the same execution request gives the same logits bytes alone, beside 1..8 other execution requests,
beside exploration traffic, however its prompt is chunked, and from a prefix-cache hit. Against the
torch modules (the reference path) the logits agree up to fp32 summation order.
"""

from __future__ import annotations

import pytest
import torch

from engine.experts import PlacementConfig
from engine.forward_batch import ForwardBatch
from engine.llm_engine import LLM
from engine.sampling_params import LogitsRecorder, SamplingParams

PLACEMENT = PlacementConfig(fast_format="int4", exact_format="bf16", formatting_layers=1)


@pytest.fixture(scope="module")
def ckpt(hf_checkpoint):
    return hf_checkpoint("qwen3_moe", num_experts_per_tok=4, num_hidden_layers=3, max_position_embeddings=1024)


def _llm(ckpt, **kw) -> LLM:
    kw = {"placement": PLACEMENT, "num_kv_blocks": 512, "block_size": 8, "max_num_batched_tokens": 64,
          "progress": False, **kw}
    return LLM(ckpt, **kw)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(1, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(llm: LLM, requests) -> dict[str, tuple[list[int], bytes]]:
    """requests: (id, prompt, params, mode) -> {id: (tokens, bytes of every logits row it sampled from)}."""
    engine, recs = llm.engine, {}
    for rid, prompt, params, mode in requests:
        recs[rid] = LogitsRecorder()
        params.logits_processors = [*params.logits_processors, recs[rid]]
        engine.add_request(rid, prompt, params, mode=mode)
    done = {}
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.token_ids, recs[out.request_id].bytes())
    return done


def _target(prompt: list[int]):
    return ("x", prompt, SamplingParams(max_tokens=10, temperature=0.7, seed=42, ignore_eos=True), "execution")


def test_engine_builds_the_fused_execution_path(ckpt):
    engine = _llm(ckpt).engine
    assert engine.runner.model.batch_invariant(True)
    serial = _llm(ckpt, batch_invariant_execution=False).engine
    assert not serial.runner.model.batch_invariant(True)
    assert engine.numerics_fingerprint("execution") != serial.numerics_fingerprint("execution")
    assert engine.numerics_fingerprint("exploration") == serial.numerics_fingerprint("exploration")


def test_execution_shares_one_forward_and_keeps_its_bytes_beside_1_to_8_others(ckpt):
    llm = _llm(ckpt, prefix_cache=False)  # each run prefills its whole prompt (a hit leaves a step the one-call path takes)
    forwards = []
    real_forward = llm.engine.runner.forward
    llm.engine.runner.forward = lambda batch: (forwards.append((batch.exact, len(batch.query_lens))),
                                               real_forward(batch))[1]
    prompt = _prompt(21, 0)
    alone = _run(llm, [_target(prompt)])["x"]
    for k in range(1, 9):
        others = [(f"o{i}", _prompt(5 + 3 * i, 10 + i), SamplingParams(max_tokens=8, temperature=0.9, seed=i,
                                                                     ignore_eos=True), "execution")
                  for i in range(k)]
        forwards.clear()
        out = _run(llm, others[: k // 2] + [_target(prompt)] + others[k // 2 :])
        assert out["x"] == alone, f"beside {k} execution requests"
        assert max(n for exact, n in forwards if exact) == k + 1  # one forward for every execution chunk
    assert llm.engine.blocks.num_free == 512


def test_execution_bytes_unchanged_beside_exploration_and_over_20_runs(ckpt):
    llm = _llm(ckpt, defer=1, fast_dense="int8", fast_lm_head="int8")
    prompt = _prompt(17, 1)
    alone = _run(llm, [_target(prompt)])["x"]
    for rep in range(20):
        load = [(f"e{i}", _prompt(4 + 5 * i, 100 * rep + i), SamplingParams(max_tokens=12, temperature=0.8,
                                                                          seed=rep * 10 + i), "exploration")
                for i in range(8)]
        assert _run(llm, load[: rep % 9] + [_target(prompt)] + load[rep % 9 :])["x"] == alone, rep


def test_chunked_prefill_of_a_700_token_prompt_is_chunk_and_batch_invariant(ckpt):
    """The same bytes whatever the prefill chunk (64 or 512 tokens) and whatever runs beside it."""
    prompt = _prompt(700, 2)
    small = _llm(ckpt, max_num_batched_tokens=64)
    want = _run(small, [_target(prompt)])["x"]
    big = _llm(ckpt, max_num_batched_tokens=512)
    assert _run(big, [_target(prompt)])["x"] == want
    crowd = [(f"o{i}", _prompt(300 + 50 * i, 20 + i), SamplingParams(max_tokens=4, ignore_eos=True),
              "execution" if i % 2 else "exploration") for i in range(4)]
    assert _run(small, crowd[:2] + [_target(prompt)] + crowd[2:])["x"] == want
    assert _run(big, crowd + [_target(prompt)])["x"] == want


def test_prefix_cache_hit_gives_the_bytes_of_a_miss(ckpt):
    prompt = _prompt(150, 3)
    want = _run(_llm(ckpt, prefix_cache=False), [_target(prompt)])["x"]
    llm = _llm(ckpt)
    assert _run(llm, [_target(prompt)])["x"] == want
    llm.engine.add_request("probe", prompt, SamplingParams(max_tokens=1), mode="execution")
    hits = []
    while llm.engine.has_work():
        hits += [o.num_cached_tokens for o in llm.engine.step() if o.finished]
    assert hits[0] > 0  # the blocks are in the cache
    assert _run(llm, [_target(prompt)])["x"] == want


def test_prefix_hits_at_any_block_keep_the_bytes_of_a_miss(ckpt):
    """On the fused path a token's KV does not depend on its chunk or batch: execution requests reuse every full
    block (the blocks of a batched prefill, a sibling's shared blocks, a finished request's output blocks) and
    sample the bytes of a cold run; the serial path keeps reusing whole prefill chunks only."""
    prompt = _prompt(45, 6)
    sibling = prompt[:27] + _prompt(18, 7)  # three whole blocks of 8 in common, and a bit more
    cold = _llm(ckpt, prefix_cache=False)
    first = _run(cold, [_target(prompt)])["x"]
    longer = prompt + first[0][:9]  # the prompt and 9 of its output tokens: 54 tokens, 6 whole blocks
    want = {name: _run(cold, [_target(p)])["x"] for name, p in (("sibling", sibling), ("longer", longer))}
    llm = _llm(ckpt)
    crowd = [(f"o{i}", _prompt(9 + 5 * i, 30 + i), SamplingParams(max_tokens=6, temperature=0.9, seed=i,
                                                                 ignore_eos=True), "execution") for i in range(3)]
    assert _run(llm, [*crowd, _target(prompt)])["x"] == first  # computed beside others: its blocks still register
    cached = {}

    def run(p: list[int]):
        llm.engine.add_request("x", p, SamplingParams(max_tokens=10, temperature=0.7, seed=42, ignore_eos=True,
                                                      logits_processors=[rec := LogitsRecorder()]), mode="execution")
        while llm.engine.has_work():
            for out in llm.engine.step():
                if out.finished:
                    cached[len(cached)] = out.num_cached_tokens
                    return out.token_ids, rec.bytes()
        raise AssertionError("no output")

    assert run(sibling) == want["sibling"] and cached[0] == 24
    assert run(prompt) == first and cached[1] == 40  # every whole block but the one holding the last prompt token
    assert run(longer) == want["longer"] and cached[2] == 48  # the first run's output blocks too
    serial = _llm(ckpt, batch_invariant_execution=False, max_num_batched_tokens=16)
    _run(serial, [_target(prompt)])
    serial.engine.add_request("again", prompt, SamplingParams(max_tokens=1), mode="execution")
    hits = []
    while serial.engine.has_work():
        hits += [o.num_cached_tokens for o in serial.engine.step() if o.finished]
    assert hits == [32]  # whole prefill chunks of 16, which the serial path's bits need


def test_tokens_computed_as_one_chunk_equal_token_by_token(ckpt):
    """What jump-forward decoding needs: tokens appended to a sequence and computed as one chunk give the
    bytes of decoding them one step at a time (here: a prompt extended by k generated tokens)."""
    llm = _llm(ckpt, prefix_cache=False)
    prompt = _prompt(30, 5)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens, _ = _run(llm, [("g", prompt, greedy, "execution")])["g"]
    rows = {}
    for k in (0, 1, 5, 11):
        rec = LogitsRecorder()
        params = SamplingParams(max_tokens=12 - k, temperature=0.0, ignore_eos=True, logits_processors=[rec])
        out = _run(llm, [(f"k{k}", prompt + tokens[:k], params, "execution")])[f"k{k}"]
        assert out[0] == tokens[k:], k
        rows[k] = rec.rows
    for k in (1, 5, 11):
        assert all(torch.equal(a, b) for a, b in zip(rows[k], rows[0][k:], strict=True)), k


def _hidden_rows(model, kv, seqs: list[tuple[list[int], list[int], int]], exact: bool = True) -> torch.Tensor:
    """One forward over several sequences: (tokens, block table, start) each -> hidden [T, H]."""
    parts = [ForwardBatch.single(t, table, 8, start=s) for t, table, s in seqs]
    batch = ForwardBatch(
        input_ids=torch.cat([p.input_ids for p in parts]), positions=torch.cat([p.positions for p in parts]),
        slot_mapping=torch.cat([p.slot_mapping for p in parts]), query_lens=[p.query_lens[0] for p in parts],
        context_lens=[p.context_lens[0] for p in parts], context_slots=[p.context_slots[0] for p in parts],
        logits_rows=torch.arange(sum(p.num_tokens for p in parts)), exact=exact)
    with torch.inference_mode():
        return model(batch, kv)


def test_fused_execution_layers_are_row_invariant_and_match_the_torch_path(ckpt):
    """Decode rows of 16 sequences with different contexts: a row's hidden bits alone equal its bits in
    any batch of M = 1..16 of them in any order (attention per sequence over its own context, dense
    and expert kernels per row); the logits agree with the torch modules up to fp32 summation order."""
    engine = _llm(ckpt).engine
    model, kv = engine.runner.model, engine.runner.kv_caches
    gen = torch.Generator().manual_seed(4)
    seqs = []
    for i in range(16):
        n = int(torch.randint(3, 60, (1,), generator=gen))
        table = list(range(i * 10, i * 10 + 10))
        prompt = _prompt(n, 30 + i)
        _hidden_rows(model, kv, [(prompt, table, 0)])
        seqs.append(([int(torch.randint(1, 500, (1,), generator=gen))], table, n))
    alone = torch.cat([_hidden_rows(model, kv, [s]) for s in seqs])  # [16, H]
    for m in range(1, 17):
        rows = torch.randperm(16, generator=gen)[:m].tolist()
        assert torch.equal(_hidden_rows(model, kv, [seqs[r] for r in rows]), alone[rows]), m
    with torch.inference_mode():
        fused = model.compute_logits(alone, exact=True)
        layers, head = model.exact_layers, model.exact_head
        model.exact_layers = model.exact_head = None  # the torch modules, execution profile
        try:
            ref = model.compute_logits(_hidden_rows(model, kv, seqs), exact=True)
        finally:
            model.exact_layers, model.exact_head = layers, head
    assert (fused - ref).abs().max().item() <= 1e-4 * ref.abs().max().item() + 1e-5
