"""Request spans: GenAI attributes, phase children, mode-switch events, traceparent in and out, JSONL export,
and trace ids that link audit records to spans."""

import json

import pytest

from gateway.audit import AuditLog
from gateway.audit_verify import verify
from gateway.telemetry import extract_context, inject_headers, setup_tracing

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


def _spans(path):
    return [json.loads(line) for line in path.read_text().split("\n") if line]  # JSONL: "\n" only (U+2028 may occur in a value)


def _one_request(tel, headers, audit=None):
    with tel.request_span(headers, model="qwen3-moe", tenant="desk-a", policy_id="finance-prod",
                          policy_digest="sha256:ab", mode="exploration", numerics_fingerprint="nf-1234",
                          params={"max_tokens": 64, "temperature": 0.0, "seed": 7, "top_p": None}) as rt:
        with rt.phase("policy", **{"moegate.policy.decision": "allow"}):
            pass
        with rt.phase("classification"):
            pass
        with rt.phase("prefill", **{"moegate.prefill.tokens": 120}):
            rt.cache_hits(["gpu", "ram"], hit_tokens=96)
        with rt.phase("decode"):
            rt.first_token()
            rt.mode_switch("exploration", "execution", reason="json_fence", token_index=17)
            rt.mode_switch("execution", "exploration", reason="fence_closed", token_index=40)
        with rt.phase("validation"):
            rt.validation("json", ok=False, errors=["$.amount: -1 is less than 0"], retries=0)
            rt.validation("json", ok=True, retries=1)
        rt.usage(input_tokens=120, output_tokens=48, finish_reasons=["stop"], response_id="chatcmpl-1",
                 response_model="qwen3-moe")
        if audit is not None:
            rec = audit.append("chat.completion", {"tenant": "desk-a", "model": "qwen3-moe"}, trace_id=rt.trace_id)
            rt.audit_record(rec.seq, rec.hash)
        out_headers = rt.inject({})
    return rt, out_headers


def test_request_span_attributes_children_and_events(tmp_path):
    path = tmp_path / "spans.jsonl"
    tel = setup_tracing("moegate-test", jsonl_path=path, batch=False)
    rt, out = _one_request(tel, {"TraceParent": TRACEPARENT})
    tel.shutdown()
    spans = _spans(path)
    root = next(s for s in spans if s["name"] == "chat qwen3-moe")
    assert root["kind"] == "SERVER" and root["resource"]["service.name"] == "moegate-test"
    # W3C: the request continues the caller's trace, as a child of the caller's span
    assert root["trace_id"] == CLIENT_TRACE == rt.trace_id and root["parent_span_id"] == CLIENT_SPAN
    assert out["traceparent"] == f"00-{CLIENT_TRACE}-{root['span_id']}-01"
    a = root["attributes"]
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "qwen3-moe"
    assert a["gen_ai.request.max_tokens"] == 64 and a["gen_ai.request.seed"] == 7
    assert "gen_ai.request.top_p" not in a  # None is omitted, not exported as a string
    assert a["gen_ai.usage.input_tokens"] == 120 and a["gen_ai.usage.output_tokens"] == 48
    assert a["gen_ai.response.finish_reasons"] == ["stop"] and a["gen_ai.response.id"] == "chatcmpl-1"
    assert a["moegate.tenant"] == "desk-a" and a["moegate.policy.id"] == "finance-prod"
    assert a["moegate.numerics.fingerprint"] == "nf-1234"
    assert a["moegate.cache.tiers_hit"] == ["gpu", "ram"] and a["moegate.cache.hit_tokens"] == 96
    assert a["moegate.validation.result"] == "pass" and a["moegate.validation.retries"] == 1
    assert a["moegate.latency.duration_s"] > 0 and 0 <= a["moegate.latency.time_to_first_token_s"]
    assert "moegate.latency.time_per_output_token_s" in a
    switches = [e for e in root["events"] if e["name"] == "moegate.mode_switch"]
    assert [(e["attributes"]["moegate.mode.to"], e["attributes"]["moegate.token_index"]) for e in switches] == [
        ("execution", 17), ("exploration", 40)]
    validations = [e["attributes"] for e in root["events"] if e["name"] == "moegate.validation"]
    assert validations[0]["moegate.validation.ok"] is False and validations[0]["moegate.validation.errors"]
    children = {s["name"]: s for s in spans if s["parent_span_id"] == root["span_id"]}
    assert set(children) == {"moegate.policy", "moegate.classification", "moegate.prefill", "moegate.decode",
                             "moegate.validation"}
    assert all(c["trace_id"] == CLIENT_TRACE for c in children.values())
    assert children["moegate.prefill"]["attributes"]["moegate.prefill.tokens"] == 120


def test_without_traceparent_starts_a_new_trace(tmp_path):
    path = tmp_path / "spans.jsonl"
    tel = setup_tracing(jsonl_path=path, batch=False)
    with tel.request_span({}, model="m") as a:
        pass
    with tel.request_span({"traceparent": "00-zzzz-not-valid-01"}, model="m") as b:
        pass
    tel.shutdown()
    roots = _spans(path)
    assert len(roots) == 2 and all(s["parent_span_id"] is None for s in roots)
    assert a.trace_id != b.trace_id and CLIENT_TRACE not in (a.trace_id, b.trace_id)


def test_extract_and_inject_header_shapes():
    for headers in ({"traceparent": TRACEPARENT}, {"TRACEPARENT": TRACEPARENT}, [("Traceparent", TRACEPARENT)]):
        carrier = inject_headers({}, extract_context(headers))
        assert carrier["traceparent"] == TRACEPARENT


def test_errors_mark_the_span(tmp_path):
    path = tmp_path / "spans.jsonl"
    tel = setup_tracing(jsonl_path=path, batch=False)
    with pytest.raises(RuntimeError):
        with tel.request_span(None, model="m") as rt:
            rt.error("validation_failed", "invalid JSON after 2 retries")
            raise RuntimeError("boom")
    with pytest.raises(ValueError, match="unknown phase"):
        with tel.request_span(None, model="m") as rt:
            with rt.phase("warp"):
                pass
    tel.shutdown()
    span = _spans(path)[0]
    assert span["status"]["code"] == "ERROR" and span["attributes"]["error.type"] == "validation_failed"
    assert any(e["name"] == "exception" for e in span["events"])


def test_audit_records_link_to_spans(tmp_path):
    spans_path, audit_path = tmp_path / "spans.jsonl", tmp_path / "audit.jsonl"
    tel = setup_tracing(jsonl_path=spans_path, batch=True)  # the production (batched) processor
    with AuditLog(audit_path, fsync="never") as audit:
        traces = [_one_request(tel, {"traceparent": f"00-{i + 1:032x}-{CLIENT_SPAN}-01"} if i else {},
                               audit)[0].trace_id for i in range(3)]
    assert tel.force_flush()
    tel.shutdown()
    assert verify(audit_path).ok
    records = [json.loads(line) for line in audit_path.read_text().split("\n") if line]
    roots = {s["trace_id"]: s for s in _spans(spans_path) if s["parent_span_id"] in (None, CLIENT_SPAN)}
    assert [r["trace_id"] for r in records] == traces and len(set(traces)) == 3
    for rec in records:
        root = roots[rec["trace_id"]]  # every record finds its span ...
        assert root["attributes"]["moegate.audit.hash"] == rec["hash"]  # ... and the span names the record
        assert root["attributes"]["moegate.audit.seq"] == rec["seq"]
