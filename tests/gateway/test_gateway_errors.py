"""Errors as the openai client expects them: 401/403/404/400/413/429, disconnect aborts, engine errors stay
with their request."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import openai
import pytest

MSG = [{"role": "user", "content": "hi"}]


def _err(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_bad_and_missing_key(gateway_server):
    with pytest.raises(openai.AuthenticationError) as e:
        gateway_server.client(key="sk-wrong-key-000000").chat.completions.create(model="moegate-demo", messages=MSG)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    r = httpx.post(gateway_server.url + "/v1/chat/completions", json={"model": "moegate-demo", "messages": MSG})
    assert r.status_code == 401 and _err(r)["type"] == "authentication_error"


def test_policy_denials_are_403(gateway_server):
    beta = gateway_server.client(key=gateway_server.key_beta)
    with pytest.raises(openai.PermissionDeniedError) as e:  # beta may not use the chat route
        beta.chat.completions.create(model="moegate-demo", messages=MSG, max_tokens=2)
    assert e.value.code == "route_not_allowed"
    assert beta.completions.create(model="moegate-demo", prompt="x", max_tokens=2).choices


def test_unknown_model_is_404(gateway_server):
    with pytest.raises(openai.NotFoundError) as e:
        gateway_server.client().chat.completions.create(model="gpt-9", messages=MSG)
    assert e.value.code == "model_not_found" and e.value.param == "model"


def test_unknown_and_unsupported_fields_are_400_naming_them(gateway_server):
    client = gateway_server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="moegate-demo", messages=MSG, extra_body={"frobnicate": 1})
    assert e.value.param == "frobnicate" and "frobnicate" in e.value.message
    for kw, param in ((dict(presence_penalty=0.5), "presence_penalty"), (dict(logprobs=True), "logprobs"),
                      (dict(temperature=3), "temperature"), (dict(n=2, stream=True), "n"),
                      (dict(logit_bias={"999999": 5}), "logit_bias"), (dict(tool_choice="required"), "tool_choice"),
                      (dict(messages=[{"role": "wizard", "content": "x"}]), "messages.0.role")):
        args = {"model": "moegate-demo", "messages": MSG, "max_tokens": 2, **kw}
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**args)
        assert e.value.param == param, (kw, e.value.message)


def test_oversized_request_is_413(gateway_server):
    big = [{"role": "user", "content": "x" * 200_000}]
    with pytest.raises(openai.APIStatusError) as e:
        gateway_server.client().chat.completions.create(model="moegate-demo", messages=big)
    assert e.value.status_code == 413 and e.value.code == "request_too_large"


def test_context_overflow_is_400_and_server_keeps_serving(gateway_server):
    client = gateway_server.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="moegate-demo", prompt=[5] * 40_000, max_tokens=2)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:  # max_tokens above the policy's cap (256)
        client.chat.completions.create(model="moegate-demo", messages=MSG, max_tokens=300)
    assert e.value.code == "max_tokens_exceeded"
    assert client.chat.completions.create(model="moegate-demo", messages=MSG, max_tokens=2).choices


async def _saturate(url: str, key: str, n: int, no_eos: dict) -> tuple[list[int], httpx.Response]:
    """Open n long streams, read one chunk of each, send one more request, then drop the streams."""
    headers = {"Authorization": f"Bearer {key}"}
    body = {"model": "moegate-demo", "messages": MSG, "max_tokens": 256, "stream": True, "temperature": 1,
            "logit_bias": no_eos}  # no EOS: the streams stay open
    async with httpx.AsyncClient(timeout=60) as http:
        ready, release = asyncio.Semaphore(0), asyncio.Event()

        async def hold() -> int:
            async with http.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
                lines = r.aiter_lines()  # keep the iterator: a dropped one closes the connection
                assert (await lines.__anext__()).startswith("data: ")
                ready.release()
                await release.wait()
                return r.status_code  # leaving the block closes the connection mid-stream

        tasks = [asyncio.create_task(hold()) for _ in range(n)]
        for _ in range(n):
            await ready.acquire()
        extra = await http.post(url + "/v1/chat/completions", headers=headers,
                                json={"model": "moegate-demo", "messages": MSG, "max_tokens": 2})
        release.set()
        return await asyncio.gather(*tasks), extra


def test_queue_full_429_and_disconnect_aborts(gateway_server):
    state = gateway_server.state
    audited = len(gateway_server.audit_records())
    codes, extra = asyncio.run(_saturate(gateway_server.url, gateway_server.key_alpha,
                                             state.settings.max_queue,
                                             {str(t): -100 for t in state.generator.eos_ids}))
    assert codes == [200] * state.settings.max_queue
    assert extra.status_code == 429 and extra.headers["Retry-After"] == "1"
    assert _err(extra)["type"] == "rate_limit_error"
    deadline = time.monotonic() + 10
    while (state.llm.num_active or state.in_flight or state.llm.engine.has_work()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert state.llm.num_active == 0 and state.in_flight == 0 and not state.llm.engine.has_work()
    metrics = state.metrics.render().decode()
    aborted = re.search(r'^moegate_aborted_requests_total\{reason="disconnect"\} (\S+)$', metrics, re.M)
    assert aborted and float(aborted.group(1)) >= 1  # the dropped streams were aborted, not run to the end
    records = [r["data"] for r in gateway_server.audit_records()[audited:]]  # one each: the 429, the cut streams
    assert sorted((r["status"], r["error"], r.get("cut")) for r in records) == \
        [(429, "server_busy", None)] + [(499, "client_disconnected", True)] * state.settings.max_queue


def test_idempotency_key_replays_and_guards(gateway_server):
    client = gateway_server.client()
    kw = dict(model="moegate-demo", messages=MSG, max_tokens=4, temperature=1.0)
    headers = {"Idempotency-Key": "order-42"}
    first = client.chat.completions.with_raw_response.create(extra_headers=headers, **kw)
    again = client.chat.completions.with_raw_response.create(extra_headers=headers, **kw)
    assert again.headers["Idempotent-Replayed"] == "true" and "Idempotent-Replayed" not in first.headers
    assert again.parse().id == first.parse().id  # the stored response, not a new generation
    with pytest.raises(openai.UnprocessableEntityError) as e:
        client.chat.completions.create(extra_headers=headers, **{**kw, "max_tokens": 5})
    assert e.value.code == "idempotency_key_reused"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(extra_headers={"Idempotency-Key": "s"}, stream=True, **kw)
    assert e.value.param == "stream"


def test_non_streaming_disconnect_aborts(gateway_server):
    state = gateway_server.state
    before = state.metrics.aborts.labels("disconnect")._value.get()
    no_eos = {str(t): -100 for t in state.generator.eos_ids}  # runs the full 256 tokens (well over 20 ms)
    body = {"model": "moegate-demo", "messages": MSG, "max_tokens": 256, "temperature": 1, "logit_bias": no_eos}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(gateway_server.url + "/v1/chat/completions", json=body,
                   timeout=httpx.Timeout(5.0, read=0.02),
                   headers={"Authorization": f"Bearer {gateway_server.key_alpha}"})
    aborts = state.metrics.aborts.labels("disconnect")._value.get
    deadline = time.monotonic() + 10
    # the client may give up before the server has even taken the request in: wait for the abort itself,
    # then for the engine to be idle
    while (aborts() == before or state.in_flight or state.llm.num_active or state.llm.engine.has_work()) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert aborts() == before + 1
    assert state.in_flight == 0 and state.llm.num_active == 0


def test_policy_rate_limit_is_429_with_retry_after(gateway_server):
    gamma = gateway_server.client(key=gateway_server.key_gamma)
    audited = len(gateway_server.audit_records())
    for _ in range(2):
        gamma.completions.create(model="moegate-demo", prompt="x", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as e:
        gamma.completions.create(model="moegate-demo", prompt="x", max_tokens=1)
    assert e.value.code == "requests_per_min_exceeded"
    assert int(e.value.response.headers["Retry-After"]) >= 1
    records = gateway_server.audit_records()[audited:]  # the denial is recorded too, once
    assert [(r["event"], r["data"]["status"], r["data"]["tenant"]) for r in records] == \
        [("text_completion.completion", 200, "gamma")] * 2 + [("request.rejected", 429, "gamma")]
    assert records[-1]["data"]["error"] == "requests_per_min_exceeded"


def test_timeout_aborts_with_504(gateway_server):
    import dataclasses

    state = gateway_server.state
    saved = state.settings
    state.settings = dataclasses.replace(saved, request_timeout_s=0.2)
    no_eos = {str(t): -100 for t in state.generator.eos_ids}
    try:
        with pytest.raises(openai.APIStatusError) as e:
            gateway_server.client().chat.completions.create(model="moegate-demo", messages=MSG, max_tokens=256,
                                                            logit_bias=no_eos)
        assert e.value.status_code == 504 and e.value.code == "timeout"
        with pytest.raises(openai.APIError) as e:  # streaming: an error event ends the stream
            list(gateway_server.client().chat.completions.create(model="moegate-demo", messages=MSG, max_tokens=256,
                                                                 logit_bias=no_eos, stream=True))
        assert "timed out" in e.value.message
    finally:
        state.settings = saved
    deadline = time.monotonic() + 10
    while (state.llm.num_active or state.llm.engine.has_work()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert state.llm.num_active == 0
