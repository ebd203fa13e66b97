"""Multi-token decoding (engine/multi_token.py): jump-forward and prompt-lookup speculation change how many
forwards a sequence takes, never its tokens.

Jump-forward: JSON Schema and tool-call output of the shipped demo model, greedy and seeded sampling, each
alone and all together, are the same bytes with forced tokens appended in chunks as token by token.
Speculation: greedy output with n-gram drafts equals greedy output without; sampled acceptance keeps the
target distribution.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.experts import PlacementConfig
from engine.kv_cache import BlockManager
from engine.llm_engine import LLM
from engine.multi_token import MultiTokenConfig, accept_drafts, propose_ngram
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import Sequence
from gateway.structured.batch import BatchMasker
from gateway.structured.build import build_constraint, json_schema_spec
from gateway.structured.tools import tool_call_spec
from gateway.structured.vocab import TokenizerInfo

DEMO = Path(__file__).parents[2] / "engine" / "assets" / "demo-moe"
PLACEMENT = PlacementConfig(fast_format="int4", exact_format="bf16", formatting_layers=1)
ORDER = {"type": "object", "properties": {
    "symbol": {"type": "string", "maxLength": 5}, "side": {"enum": ["buy", "sell"]},
    "quantity": {"type": "integer", "minimum": 1}, "order_type": {"enum": ["market", "limit"]}},
    "required": ["symbol", "side", "quantity", "order_type"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "place_order", "parameters": ORDER}},
         {"type": "function", "function": {"name": "get_quote", "parameters": {
             "type": "object", "properties": {"symbol": {"type": "string"}}, "required": ["symbol"]}}}]
TABLE = "\n".join(f"| {s} | {p} | {q} |" for s, p, q in
                  [("AAPL", "187.25", 150), ("MSFT", "402.10", 20), ("NVDA", "903.50", 75), ("AMZN", "178.90", 40)])


def _llm(**kw) -> LLM:
    return LLM(DEMO, progress=False, placement=PLACEMENT, num_kv_blocks=256, **kw)


@pytest.fixture(scope="module")
def engines():
    return {jf: _llm(jump_forward_tokens=jf).engine for jf in (0, 32)}


def _constrained(engine, masker):
    tok = TokenizerInfo.from_file(DEMO / "tokenizer.json", sorted(engine.eos_token_ids))
    prompt = engine.tokenizer.encode("Buy 100 AAPL at market. Answer with the order:")
    out = []
    for kind, spec in (("json", json_schema_spec(ORDER)), ("tool", tool_call_spec(TOOLS, tok, "required"))):
        for temp in (0.0, 0.7):
            c = build_constraint(spec, tok, max_tokens=96, mask_batcher=masker)
            params = SamplingParams(max_tokens=96, temperature=temp, seed=11, logits_processors=[c])
            out.append((f"{kind}-{temp}", prompt, params, "execution"))
    return out


def _drive(engine, requests) -> tuple[dict[str, tuple[list[int], str]], int]:
    for rid, prompt, params, mode in requests:
        engine.add_request(rid, prompt, params, mode=mode)
    done, steps = {}, 0
    while engine.has_work():
        steps += 1
        done.update({o.request_id: (o.token_ids, o.text) for o in engine.step() if o.finished})
    return done, steps


@pytest.mark.parametrize("batched", [True, False], ids=["mask-batcher", "per-row"])
def test_jump_forward_keeps_the_bytes_alone_and_together(engines, batched):
    masker = BatchMasker(num_threads=1, prefetch=False) if batched else None
    plain, forced = engines[0], engines[32]
    assert forced.decoder.chunk_invariant
    want, plain_steps = {}, 0
    for request in _constrained(plain, masker):  # token by token, each alone
        got, steps = _drive(plain, [request])
        want.update(got)
        plain_steps += steps
    assert plain.decoder.stats.forced_tokens == 0
    alone, jf_steps = {}, 0
    for request in _constrained(forced, masker):
        got, steps = _drive(forced, [request])
        alone.update(got)
        jf_steps += steps
    together, _ = _drive(forced, _constrained(forced, masker))
    assert alone == want and together == want
    assert all(text.startswith("<tool_call>") for rid, (_, text) in want.items() if rid.startswith("tool"))
    assert forced.decoder.stats.forced_tokens > 0 and jf_steps < plain_steps


def test_jump_forward_needs_a_chunk_invariant_path():
    engine = _llm(jump_forward_tokens=32, batch_invariant_execution=False).engine
    masker = BatchMasker(num_threads=1, prefetch=False)
    _drive(engine, _constrained(engine, masker)[:1])
    masker.close()
    assert not engine.decoder.chunk_invariant and engine.decoder.stats.forced_tokens == 0


def test_greedy_speculation_equals_plain_greedy():
    """On the chunk-invariant execution path: bit for bit. (Exploration's torch path computes a chunk of k
    rows with other kernels than a decode row, as it does a prefill chunk, so there a near tie can flip.)"""
    plain, spec = _llm().engine, _llm(speculative_tokens=4).engine
    prompt = plain.tokenizer.encode_chat([{"role": "user", "content": f"Repeat this table exactly:\n{TABLE}"}])
    requests = [(f"r{i}", prompt[i:], SamplingParams(max_tokens=64, ignore_eos=True), "execution") for i in range(3)]
    want, plain_steps = _drive(plain, requests)
    got, spec_steps = _drive(spec, requests)
    assert got == want
    stats = spec.decoder.stats
    assert stats.accepted_tokens > 0 and spec_steps < plain_steps
    assert stats.sampled_tokens == sum(len(ids) for ids, _ in want.values())


def test_seeded_execution_sampling_never_speculates():
    engine = _llm(speculative_tokens=4).engine
    prompt = engine.tokenizer.encode(f"{TABLE}\n{TABLE}\n")
    _drive(engine, [("s", prompt, SamplingParams(max_tokens=24, temperature=0.8, seed=1), "execution")])
    assert engine.decoder.stats.drafted_tokens == 0


def test_propose_ngram_takes_the_latest_longest_match():
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2, 3, 1) == [7, 8]
    assert propose_ngram([5, 6, 4, 6], 3, 3, 1) == [4, 6]  # only the last token matches
    assert propose_ngram([1, 2, 3], 4, 3, 1) == []
    assert propose_ngram([1, 2, 1, 2], 4, 3, 2) == [1, 2]


def test_sampled_acceptance_keeps_the_target_distribution():
    logits = torch.tensor([[1.0, 0.2, 2.0, -1.0, 0.5], [0.0, 0.0, 0.0, 0.0, 0.0]])
    seq = Sequence("d", [1], SamplingParams(temperature=1.0, seed=5))
    n, counts, accepted = 20000, torch.zeros(5), 0
    for _ in range(n):
        out = accept_drafts(logits.clone(), [2], seq)
        counts[out[0]] += 1
        accepted += len(out) == 2
    target = torch.softmax(logits[0], -1)
    assert torch.allclose(counts / n, target, atol=0.015), (counts / n, target)
    assert abs(accepted / n - float(target[2])) < 0.015  # a draft is kept with its target probability


def test_greedy_acceptance_stops_at_the_first_disagreement():
    rows = torch.full((4, 6), -1.0)
    rows[0, 3] = rows[1, 4] = rows[2, 1] = rows[3, 0] = 1.0  # the target's choices: 3, 4, 1, then 0
    seq = Sequence("g", [1], SamplingParams())
    assert accept_drafts(rows, [3, 4, 5], seq) == [3, 4, 1]
    assert accept_drafts(rows, [3, 4, 1], seq) == [3, 4, 1, 0]
    assert accept_drafts(rows, [2, 4, 1], seq) == [3]


def test_scheduler_drops_drafts_it_cannot_verify_in_one_chunk():
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4), BlockManager(16, 4))
    seq = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=8))
    sched.add(seq)
    (c,) = sched.schedule()
    seq.num_computed, seq.output_token_ids = 3, [4]
    seq.draft_token_ids = [5, 6]
    (c,) = sched.schedule()
    assert (c.num_tokens, c.num_logits) == (3, 3)  # the last token and both drafts, logits at each
    seq.num_computed = 3  # as if every draft was rejected
    seq.draft_token_ids = [5, 6, 7, 8]  # 5 tokens do not fit the budget of 4
    (c,) = sched.schedule()
    assert seq.draft_token_ids == [] and (c.num_tokens, c.num_logits) == (1, 1)


def test_config_is_checked():
    with pytest.raises(ValueError, match="ngram"):
        MultiTokenConfig(speculative_tokens=2, ngram_max=0)
    with pytest.raises(ValueError, match=">= 0"):
        _llm(jump_forward_tokens=-1)


def test_detector_knows_the_token_that_would_close_a_segment():
    """Jump-forward stops before a closing token: its KV is computed in the mode it switches back to."""
    from engine.mode import Mode
    from engine.segments import SegmentDetector

    pieces = [b"", b"<tool_call>", b"</tool_call>", b"```json\n", b"{}", b"\n```", b"\n", b"```"]
    det = SegmentDetector(pieces, 1, 2, {"tool_call": Mode.EXECUTION, "json_fence": Mode.EXECUTION})
    assert not det.closes(2)  # nothing open
    det.push(1)
    assert det.closes(2) and not det.closes(5)
    det.push(2)
    det.push(6)
    det.push(3)  # a json fence opens
    assert det.open is not None and det.open.kind == "json_fence"
    det.push(4)
    assert det.closes(5) and not det.closes(4) and not det.closes(2)
    det.push(6)
    assert det.closes(7)  # "\n" then "```" closes too
