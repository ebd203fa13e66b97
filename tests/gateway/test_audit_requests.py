"""Every request that reaches the gateway gets exactly one audit record: answered, denied, invalid, too large,
cut mid-stream, or carrying odd Unicode; a crash that tears the last record does not stop the next start."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest

from gateway.audit_verify import verify
from tests.gateway.conftest import serve_process

MSG = [{"role": "user", "content": "hi"}]
ROOT = Path(__file__).resolve().parents[2]


def _one_new_record(server, send):
    """Run `send()`; exactly one record was appended for it: return (result, record)."""
    before = len(server.audit_records())
    result = send()
    records = server.audit_records()
    assert len(records) == before + 1, [r["event"] for r in records[before:]]
    return result, records[-1]


def _post(server, body, key=None, path="/v1/chat/completions", **kw):
    headers = {"Authorization": f"Bearer {key or server.key_alpha}", "Content-Type": "application/json"}
    return httpx.post(server.url + path, content=json.dumps(body).encode(), headers=headers, timeout=60, **kw)


def test_answers_and_denials_each_get_one_record(gateway_server):
    s = gateway_server
    ok, rec = _one_new_record(s, lambda: s.client().chat.completions.create(model="moegate-demo", messages=MSG,
                                                                            max_tokens=2))
    assert rec["event"] == "chat.completion" and rec["data"]["request_id"] == ok.id and rec["data"]["status"] == 200
    probes = [  # (request, status, error code, tenant)
        (lambda: _post(s, {"model": "moegate-demo", "messages": MSG}, key="sk-wrong-key-000000"), 401,
         "invalid_api_key", None),
        (lambda: httpx.post(s.url + "/v1/chat/completions", json={"model": "moegate-demo", "messages": MSG}), 401,
         "missing_api_key", None),
        (lambda: _post(s, {"model": "moegate-demo", "messages": MSG, "max_tokens": 2}, key=s.key_beta), 403,
         "route_not_allowed", "beta"),
        (lambda: _post(s, {"model": "gpt-9", "messages": MSG}), 404, "model_not_found", "alpha"),
        (lambda: _post(s, {"model": "moegate-demo", "messages": MSG, "frobnicate": 1}), 400, "unknown_parameter",
         "alpha"),
        (lambda: _post(s, {"model": "moegate-demo", "messages": MSG, "max_tokens": 300}), 400,
         "max_tokens_exceeded", "alpha"),
        (lambda: _post(s, {"model": "moegate-demo", "messages": [{"role": "user", "content": "x" * 200_000}]}), 413,
         "request_too_large", None),
        (lambda: httpx.get(s.url + "/v1/nowhere"), 404, "not_found", None),
    ]
    for send, status, code, tenant in probes:
        response, rec = _one_new_record(s, send)
        assert response.status_code == status, response.text
        assert rec["event"] == "request.rejected", rec
        assert (rec["data"]["status"], rec["data"]["error"], rec["data"]["tenant"]) == (status, code, tenant)
        assert rec["data"]["policy_id"] == "gateway-test" and rec["data"]["message"]
        assert "x" * 100 not in json.dumps(rec)  # a denied request's body is not copied
    assert verify(s.state_dir / "audit.jsonl").ok


def test_answers_without_an_endpoint_record_get_one(gateway_server):
    s = gateway_server
    models, rec = _one_new_record(s, lambda: httpx.get(s.url + "/v1/models",
                                                       headers={"Authorization": f"Bearer {s.key_alpha}"}))
    assert models.status_code == 200 and rec["event"] == "request"
    assert (rec["data"]["route"], rec["data"]["status"], rec["data"]["tenant"]) == ("/v1/models", 200, "alpha")
    kw = dict(model="moegate-demo", messages=MSG, max_tokens=2, extra_headers={"Idempotency-Key": "audit-replay"})
    first, rec = _one_new_record(s, lambda: s.client().chat.completions.create(**kw))
    assert rec["event"] == "chat.completion"
    again, rec = _one_new_record(s, lambda: s.client().chat.completions.create(**kw))
    assert again.id == first.id and rec["event"] == "request" and rec["data"]["idempotent_replayed"] is True


def test_a_stream_cut_after_the_first_chunk_is_recorded_as_cut(gateway_server):
    s = gateway_server
    no_eos = {str(t): -100 for t in s.state.generator.eos_ids}  # 256 tokens: the client leaves well before
    body = {"model": "moegate-demo", "messages": MSG, "max_tokens": 256, "stream": True, "temperature": 1,
            "logit_bias": no_eos}
    before = len(s.audit_records())
    with httpx.Client(timeout=60) as http, http.stream(
            "POST", s.url + "/v1/chat/completions", json=body,
            headers={"Authorization": f"Bearer {s.key_alpha}"}) as r:
        lines = r.iter_lines()
        first = json.loads(next(lines).removeprefix("data: "))
        rid = r.headers["X-Request-Id"]
    assert first["choices"][0]["delta"]["role"] == "assistant"
    deadline = time.monotonic() + 30  # the server learns of the close and settles the request
    while (len(s.audit_records()) == before or s.state.in_flight) and time.monotonic() < deadline:
        time.sleep(0.05)
    records = s.audit_records()[before:]
    assert len(records) == 1, records
    rec = records[0]["data"]
    assert rec["request_id"] == rid and rec["cut"] is True and rec["status"] == 499
    assert rec["error"] == "client_disconnected" and rec["finish_reasons"] is None
    assert 1 <= rec["chunks_sent"] < 256
    sent = json.loads(rec["output"])[0]["content"]
    assert isinstance(sent, str) and len(s.state.llm.tokenizer.encode(sent)) < 256
    assert s.state.in_flight == 0


def test_a_finished_stream_is_recorded_before_done(gateway_server):
    s = gateway_server
    before = len(s.audit_records())
    with httpx.Client(timeout=60) as http, http.stream(
            "POST", s.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {s.key_alpha}"},
            json={"model": "moegate-demo", "messages": MSG, "max_tokens": 4, "stream": True}) as r:
        for line in r.iter_lines():
            if line == "data: [DONE]":
                assert len(s.audit_records()) == before + 1  # written before the client saw [DONE]
                break
        else:
            raise AssertionError("no [DONE]")
    rec = s.audit_records()[-1]["data"]
    assert rec["status"] == 200 and "cut" not in rec and rec["request_id"] == r.headers["X-Request-Id"]


def test_lone_surrogate_in_user_is_recorded_escaped(gateway_server):
    s = gateway_server
    response, rec = _one_new_record(s, lambda: _post(s, {"model": "moegate-demo", "messages": MSG, "max_tokens": 2,
                                                         "user": "desk-\ud800"}))
    assert response.status_code == 200 and rec["data"]["user"] == "desk-\ud800"
    raw = (s.state_dir / "audit.jsonl").read_bytes().splitlines()[-1]
    assert b"desk-\\ud800" in raw
    raw.decode("utf-8")
    assert verify(s.state_dir / "audit.jsonl").ok


def _serve(checkpoint: Path, state_dir: Path, env: dict) -> tuple[subprocess.Popen, str]:
    return serve_process(["--model", str(checkpoint), "--device", "cpu", "--log-level", "warning",
                          "--state-dir", str(state_dir)], env, timeout_s=90)


def _chat(url: str) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", headers={"Authorization": "Bearer anything"}, timeout=60,
                      json={"model": "moegate-demo", "messages": MSG, "max_tokens": 2})


def test_torn_record_after_a_crash_is_quarantined_and_serving_resumes_keyed(tiny_checkpoint, tmp_path, capsys):
    from gateway.cli import main

    env = {**os.environ, "PYTHONPATH": str(ROOT), "MOEGATE_AUDIT_KEY": "a-deployment-secret-0123456789"}
    log = tmp_path / "audit.jsonl"
    proc, url = _serve(tiny_checkpoint(), tmp_path, env)
    try:
        assert _chat(url).status_code == 200 and _chat(url).status_code == 200
    finally:
        proc.send_signal(signal.SIGKILL)  # a crash: no shutdown, ...
        proc.wait(30)
    with open(log, "ab") as f:  # ... in the middle of writing a record
        f.write(b'{"data":{"request_id":"chatcmpl-torn","status":20')
    proc, url = _serve(tiny_checkpoint(), tmp_path, env)  # starts (it refused with exit 3 before)
    try:
        assert _chat(url).status_code == 200
    finally:
        proc.terminate()
        proc.wait(30)
    records = [json.loads(line) for line in log.read_bytes().splitlines()]
    assert [r["event"] for r in records] == ["chat.completion"] * 2 + ["audit.quarantine", "chat.completion"]
    assert all(r["v"] == 2 for r in records)  # keyed: HMAC-SHA256
    aside = tmp_path / records[2]["data"]["file"]
    assert aside.read_bytes() == b'{"data":{"request_id":"chatcmpl-torn","status":20'
    os.environ["MOEGATE_AUDIT_KEY"] = env["MOEGATE_AUDIT_KEY"]
    try:
        assert main(["audit", "verify", str(log)]) == 0
    finally:
        del os.environ["MOEGATE_AUDIT_KEY"]
    out = capsys.readouterr().out
    assert "ok: 4 records, keyed (HMAC-SHA256)" in out and f"quarantined in {aside} (kept)" in out
    assert main(["audit", "verify", str(log)]) == 1  # without the key the chain cannot be checked
    assert "give its key" in capsys.readouterr().err


@pytest.mark.parametrize("stream", [False, True])
def test_an_invalid_schema_is_recorded_once(gateway_server, stream):
    s = gateway_server
    kw = dict(model="moegate-demo", messages=MSG, max_tokens=2, stream=stream,
              response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}})

    def send():
        with pytest.raises(openai.APIError) as e:
            out = s.client().chat.completions.create(**kw)
            list(out) if stream else None
        return e.value

    error, rec = _one_new_record(s, send)
    assert rec["data"]["status"] == 400 and rec["data"]["tenant"] == "alpha"
    assert rec["data"]["message"] in error.message
    if not stream:
        assert error.status_code == 400
