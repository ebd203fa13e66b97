"""Classification and the segment detector: on token streams directly, then the engine's segment tracker with
the gateway's constraints, a mixed response (free text, a tool call, free text) through the server showing
the mode switches in order, and a tool call inside free text equal to an all-execution run from its prefix."""

from __future__ import annotations

import json

import pytest

from engine.mode import EXECUTION, EXPLORATION
from engine.segments import SegmentDetector, SegmentTracker
from gateway.classify import classify, request_features

ALL_EXEC = {"tool_call": EXECUTION, "json_fence": EXECUTION, "sql_fence": EXECUTION}


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    from gateway.structured.vocab import TokenizerInfo

    return TokenizerInfo.from_file(tiny_checkpoint() / "tokenizer.json", [2048, 2050])


def _detector(tok, modes=ALL_EXEC, fences=frozenset({"json", "sql"})):
    return SegmentDetector(tok.token_bytes, tok.token_id("<tool_call>"), tok.token_id("</tool_call>"), modes, fences)


def test_classify_by_request_and_policy():
    structural = request_features(response_format="json_schema", tools=False, tool_choice=None)
    assert classify(structural, []).mode == EXECUTION  # structure asked: execution whatever the policy
    named = request_features(response_format=None, tools=True, tool_choice="named")
    assert classify(named, []).reason == "request:tools_required"
    auto = request_features(response_format=None, tools=True, tool_choice="auto")
    assert classify(auto, ["json_schema"]).mode == EXPLORATION
    assert classify(auto, ["tools_any"]).reason == "policy:tools_any"
    assert classify(set(), ["always"]).reason == "policy:always"
    assert request_features(response_format=None, tools=True, tool_choice="none") == set()


def test_tool_call_segment_on_the_token_stream(tok):
    before, call, after = tok.encode("Let me check."), tok.encode('{"name": "get_quote", "arguments": {}}'), \
        tok.encode(" Done.")
    ids = before + [tok.token_id("<tool_call>")] + call + [tok.token_id("</tool_call>")] + after
    det = _detector(tok)
    decisions = det.push_all(ids)
    start, end = len(before), len(before) + len(call) + 1
    assert [(d.mode, d.reason, d.token_index, d.segment) for d in decisions] == [
        (EXECUTION, "tool_call_start", start, "tool_call"), (EXPLORATION, "tool_call_end", end, "tool_call")]
    assert (det.segments[0].start, det.segments[0].end) == (start, end + 1)
    assert det.mode == EXPLORATION


def test_fence_segments_and_policy_modes(tok):
    ids = tok.encode("Here:\n```json\n") + tok.encode('{"a": 1}') + tok.encode("\n```") + tok.encode(" then\n```sql\n")
    ids += tok.encode("SELECT 1") + tok.encode("\n```")
    det = _detector(tok)
    decisions = det.push_all(ids)
    assert [(d.mode, d.reason, d.segment) for d in decisions] == [
        (EXECUTION, "fence_open:json", "json_fence"), (EXPLORATION, "fence_close", "json_fence"),
        (EXECUTION, "fence_open:sql", "sql_fence"), (EXPLORATION, "fence_close", "sql_fence")]
    body = det.segments[0]
    assert tok.decode(ids[body.start:body.end]) == '{"a": 1}\n```'
    # the policy keeps json fences in exploration; a fence inside a line is not a fence
    det = _detector(tok, {**ALL_EXEC, "json_fence": EXPLORATION})
    assert det.push_all(ids)[0].segment == "sql_fence"
    assert _detector(tok).push_all(tok.encode("inline ```json\n{}")) == []


def test_detector_is_incremental(tok):
    """Fed one token at a time or all at once, the decisions are the same (processor and writer agree)."""
    ids = tok.encode("a\n```json\n") + tok.encode("[1]") + tok.encode("\n```") + [tok.token_id("<tool_call>")]
    whole = _detector(tok).push_all(ids)
    det = _detector(tok)
    step = [d for i in range(1, len(ids) + 1) for d in det.push_all(ids[:i])]
    assert whole == step and len(whole) == 3


QUOTE = {"type": "function", "function": {"name": "get_quote", "parameters": {
    "type": "object", "properties": {"symbol": {"type": "string", "maxLength": 6}},
    "required": ["symbol"], "additionalProperties": False}}}


def test_mixed_response_switches_in_order(gateway_server):
    """A moderate logit_bias on <tool_call> lets the sampled text open a call after some free text; the
    call is constrained (execution) until </tool_call>, then free text resumes (exploration)."""
    client = gateway_server.client()
    open_id = gateway_server.state.generator.tool_open
    kw = dict(model="moegate-demo", messages=[{"role": "user", "content": "quote AAPL"}], tools=[QUOTE],
              parallel_tool_calls=False, max_tokens=48, temperature=1.0, logit_bias={str(open_id): 7})
    mixed = None
    for seed in range(8):
        r = client.chat.completions.create(seed=seed, **kw)
        decisions = r.model_extra["moegate"]["choices"][0]["decisions"]
        switches = decisions[1:]
        assert [d["mode"] for d in switches] == [EXECUTION, EXPLORATION][: len(switches)]
        if switches:  # every call that left the server is valid
            args = json.loads(r.choices[0].message.tool_calls[0].function.arguments)
            assert set(args) == {"symbol"} and len(args["symbol"]) <= 6
        if len(switches) == 2 and switches[0]["token_index"] > 0 and switches[1]["token_index"] < r.usage.completion_tokens - 1:
            mixed = (seed, r, switches)
            break
    assert mixed is not None, "no sampled response had text, then a tool call, then text"
    seed, r, (to_exec, to_explore) = mixed
    assert decisions[0] == {"mode": "exploration", "reason": "default", "token_index": None, "engine_applied": True}
    assert to_exec["reason"] == "tool_call_start" and to_explore["reason"] == "tool_call_end"
    assert to_exec["token_index"] < to_explore["token_index"]
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content

    # the same response streamed: text deltas, the tool-call deltas, then text deltas again
    order = []
    for chunk in client.chat.completions.create(seed=seed, stream=True, **kw):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None and delta.tool_calls:
            order.append("tool")
        elif delta is not None and delta.content:
            order.append("text")
        if chunk.choices and chunk.choices[0].finish_reason:
            final = chunk.model_extra["moegate"]["decisions"]
    collapsed = [k for i, k in enumerate(order) if i == 0 or order[i - 1] != k]
    assert collapsed == ["text", "tool", "text"]
    assert [d["mode"] for d in final[1:]] == [EXECUTION, EXPLORATION]
    assert final[1]["token_index"] == to_exec["token_index"]


def _drive(tok, proc, ids, steps=80, seed=0):
    """Greedy decoding over random logits through the processor (the engine's sampler does the same)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = list(ids)
    for _ in range(steps):
        row = torch.randn(tok.vocab_size + 55, generator=gen)  # wider than the vocabulary, like the model
        row[tok.vocab_size:] = float("-inf")
        ids.append(int(torch.argmax(proc(ids, row))))
        if proc.detector.mode == EXPLORATION and len(proc.detector.segments) == 1 and proc.detector.segments[0].end:
            break
    return ids


class _Driven:
    """A SegmentTracker driven as the engine drives it: masks the next row, then sees the sampled token."""

    def __init__(self, tracker: SegmentTracker):
        self.tracker, self.switches = tracker, []
        self.detector = tracker.detector

    @property
    def error(self):
        return self.tracker.error

    def __call__(self, ids, row):
        while self.detector._next < len(ids):  # tokens sampled since the last row
            s = self.tracker.push(int(ids[self.detector._next]))
            if s is not None:
                self.switches.append(s)
        return self.tracker(ids, row)


def _processor(tok, fences, budget=300, modes=ALL_EXEC):
    from gateway.plan import Plan
    from gateway.segments import segment_rules

    plan = Plan(prompt_ids=[1], max_tokens=budget, temperature=0.0, top_p=1.0, top_k=0, seed=None, stop=[],
                logit_bias={}, n=1, decision=None, features=set(), segment_modes=dict(modes), tools=fences.tools)
    import dataclasses

    rules = dataclasses.replace(segment_rules(tok, [2048, 2050], plan, fences), banned=None)  # constraints only
    proc = _Driven(SegmentTracker(rules))
    return proc, proc.switches


def test_json_fence_is_constrained_then_released(tok):
    """After a ```json line the processor masks with the segment's constraint until the closing fence, then
    lets free text through again; the body validates."""
    from gateway.segments import SegmentFences
    from gateway.structured.segment import segment_body
    from gateway.structured.validate import validate_json

    proc, switches = _processor(tok, SegmentFences([]))
    ids = _drive(tok, proc, tok.encode("Here:\n```json\n"), steps=300)
    seg = proc.detector.segments[0]
    assert seg.end is not None and proc.error is None
    assert [d.mode for d in switches] == [EXECUTION, EXPLORATION]
    text = tok.decode(ids[seg.start:seg.end])
    assert text.endswith("\n```")
    validate_json(segment_body(text), {})
    import torch

    row = torch.zeros(tok.vocab_size)
    assert torch.isfinite(proc(ids, row)).all()  # released: exploration masks nothing


def test_sql_fence_applies_the_sql_grammar(tok):
    import torch

    from gateway.segments import SegmentFences
    from gateway.structured.sql_schema import DatabaseSchema, SQLPolicy

    db = (DatabaseSchema.from_mapping({"prices": ["ticker", "price"]}), SQLPolicy("sqlite"))
    proc, switches = _processor(tok, SegmentFences([], sql=db))
    ids = tok.encode("Query:\n```sql\n")
    row = proc(ids, torch.zeros(tok.vocab_size))
    allowed = [tok.decode([i]) for i in torch.nonzero(torch.isfinite(row)).flatten().tolist()]
    assert switches[0].segment == "sql_fence" and 0 < len(allowed) < 50
    assert all(any(w.startswith(a.lower()) for w in ("select", "with", "(")) for a in allowed), allowed
    proc_no_sql, _ = _processor(tok, SegmentFences([]))  # no schema given: a ```sql fence stays free text
    assert torch.isfinite(proc_no_sql(ids, torch.zeros(tok.vocab_size))).all()


def test_processor_failure_ends_only_its_sequence(tok):
    """A constraint that cannot be built (a ```sql fence the detector opens without a schema) must not raise
    into the engine loop: that sequence gets EOS only and the error is reported to its request."""
    import torch

    from engine.segments import SegmentRules
    from gateway.segments import SegmentFences, segment_factory

    rules = SegmentRules(tok.token_bytes, tok.token_id("<tool_call>"), tok.token_id("</tool_call>"), ALL_EXEC,
                         constraint=segment_factory(tok, [2048, 2050], 64, SegmentFences([])), eos_ids=(2048, 2050))
    proc = _Driven(SegmentTracker(rules))
    row = proc(tok.encode("Query:\n```sql\n"), torch.zeros(tok.vocab_size))
    assert proc.error is not None
    assert torch.nonzero(torch.isfinite(row)).flatten().tolist() == [2048, 2050]


def test_decisions_reach_the_audit_log_and_traces(gateway_server):
    """The mode decisions of a response are in its hash-chained audit record and in its trace."""
    from gateway.audit_verify import verify

    open_id = gateway_server.state.generator.tool_open
    r = gateway_server.client().chat.completions.create(
        model="moegate-demo", messages=[{"role": "user", "content": "audit me"}], tools=[QUOTE],
        parallel_tool_calls=False, max_tokens=40, temperature=0, logit_bias={str(open_id): 100})
    switches = r.model_extra["moegate"]["choices"][0]["decisions"][1:]
    assert [d["mode"] for d in switches] == [EXECUTION, EXPLORATION]
    audit_path = gateway_server.state.settings.audit_path
    assert verify(audit_path, use_head=False).ok
    records = [json.loads(line) for line in audit_path.read_text().split("\n") if line]
    mine = next(rec for rec in records if rec["data"].get("request_id") == r.id)
    assert mine["data"]["decisions"][0][1:] == switches
    assert mine["data"]["tenant"] == "alpha" and "audit me" in mine["data"]["input"]  # policy audit level: full
    gateway_server.state.telemetry.force_flush()
    spans = [json.loads(line) for line in gateway_server.state.settings.trace_path.read_text().split("\n") if line]
    span = next(s for s in spans if s["trace_id"] == mine["trace_id"] and s["name"].startswith("chat"))
    events = [e for e in span["events"] if e["name"] == "moegate.mode_switch"]
    assert [(e["attributes"]["moegate.mode.to"], e["attributes"]["moegate.token_index"]) for e in events] == \
        [(d["mode"], d["token_index"]) for d in switches]


def test_tool_call_in_free_text_equals_an_all_execution_run_from_its_prefix(tiny_checkpoint, tok):
    """The engine switches at the token that opens a tool call (resync "recompute"): every token of the call
    is computed in execution mode, bit for bit what an all-execution run from the same prefix computes (the
    logits rows and the tokens), though exploration runs other weights (int4 experts) and defers experts.
    With resync "keep" the call's logits come from exploration's KV and differ."""
    from engine.experts import PlacementConfig
    from engine.llm_engine import LLM
    from engine.output import RequestOutput
    from engine.sampling_params import LogitsRecorder, SamplingParams
    from engine.segments import SegmentEnd, SegmentStart
    from gateway.plan import Plan
    from gateway.segments import SegmentFences, segment_factory, segment_rules

    llm = LLM(tiny_checkpoint(), placement=PlacementConfig(fast_format="int4", exact_format="bf16",
                                                           formatting_layers=1), defer=1, num_kv_blocks=64,
              block_size=8, progress=False)
    engine, eos = llm.engine, sorted(llm.engine.eos_token_ids)
    fences, budget, k = SegmentFences([QUOTE]), 40, 3
    plan = Plan(prompt_ids=[1], max_tokens=budget, temperature=0.0, top_p=1.0, top_k=0, seed=None, stop=[],
                logit_bias={}, n=1, decision=None, features=set(), segment_modes=dict(ALL_EXEC), tools=[QUOTE],
                parallel_tool_calls=False)
    open_id, prompt = tok.token_id("<tool_call>"), tok.encode("quote AAPL please")

    def open_at_k(ids, row):  # free text first, then the model "chooses" a tool call at token k
        if len(ids) == k:
            row[:] = float("-inf")
            row[open_id] = 0.0
        return row

    def run(rid, ids, params, mode) -> list[RequestOutput]:
        engine.add_request(rid, ids, params, mode=mode)
        outs = []
        while engine.has_work():
            outs += [o for o in engine.step() if o.request_id == rid]
        return outs

    def switched(resync):
        rec = LogitsRecorder()
        params = SamplingParams(max_tokens=budget, logits_processors=[open_at_k, rec], resync=resync,
                                segments=segment_rules(tok, eos, plan, fences))
        outs = run(f"free-{resync}", prompt, params, "exploration")
        return outs, rec

    outs, rec = switched("recompute")
    events = [e for o in outs for e in o.segment_events]
    start, end = events[0], events[1]
    assert isinstance(start, SegmentStart) and start.applied and start.switch.token_index == k
    assert isinstance(end, SegmentEnd) and end.token_ids[0] == open_id
    tokens = outs[-1].token_ids
    call = tokens[k + 1:end.switch.token_index + 1]  # the call's tokens after <tool_call>, up to </tool_call>
    assert outs[-1].text == "".join(o.new_text for o in outs)  # free text only: the call is in its event
    assert tok.decode(call).count('"name": "get_quote"') == 1

    constraint = segment_factory(tok, eos, budget, fences)("tool_call", k)  # as the engine built it at token k
    ref_rec = LogitsRecorder()
    ref = run("exec", prompt + tokens[:k + 1], SamplingParams(
        max_tokens=len(call), logits_processors=[ref_rec, lambda ids, row: constraint([open_id, *ids], row)]),
        "execution")
    assert ref[-1].token_ids == call
    rows = slice(k + 1, k + 1 + len(call))
    assert b"".join(r.numpy().tobytes() for r in rec.rows[rows]) == ref_rec.bytes()

    kept, kept_rec = switched("keep")
    assert b"".join(r.numpy().tobytes() for r in kept_rec.rows[rows]) != ref_rec.bytes()
