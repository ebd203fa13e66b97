"""Hostile input gets a typed 4xx naming the problem, never a 5xx: 64-bit seeds, unpaired surrogates anywhere
in the text a model, grammar or stop matcher reads, and oversized bodies sent chunked."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

MSG = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get_quote", "description": "quote",
                                         "parameters": {"type": "object", "properties": {"t": {"type": "string"}}}}}


def _post(server, body: dict, path: str = "/v1/chat/completions") -> httpx.Response:
    """JSON with \\uXXXX escapes (a lone surrogate travels as `\\ud800`, as any JSON encoder writes it)."""
    return httpx.post(server.url + path, content=json.dumps(body).encode(), timeout=60,
                      headers={"Authorization": f"Bearer {server.key_alpha}", "Content-Type": "application/json"})


@pytest.mark.parametrize("seed", [2**70, -(2**70), 2**63, -(2**63) - 1])
def test_seed_outside_int64_is_400(gateway_server, seed):
    with pytest.raises(openai.BadRequestError) as e:
        gateway_server.client().chat.completions.create(model="moegate-demo", messages=MSG, max_tokens=2, seed=seed)
    assert e.value.param == "seed" and e.value.code == "invalid_value"


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63)])
def test_seed_at_int64_bounds_is_served(gateway_server, seed):
    client = gateway_server.client()
    first = client.chat.completions.create(model="moegate-demo", messages=MSG, max_tokens=4, seed=seed, n=2,
                                           temperature=1)
    again = client.chat.completions.create(model="moegate-demo", messages=MSG, max_tokens=4, seed=seed, n=2,
                                           temperature=1)
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]


BAD = "a\ud800b"


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": BAD}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": BAD}]}]},
     "messages.0.content.0.text"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "s", "name": BAD}, *MSG]}, "messages.0.name"),
    ("/v1/chat/completions", {"messages": MSG, "tools": [{**TOOL, "function": {**TOOL["function"],
                                                                               "description": BAD}}]},
     "tools.0.function.description"),
    ("/v1/chat/completions", {"messages": MSG, "tools": [{**TOOL, "function": {**TOOL["function"], "parameters": {
        "type": "object", "properties": {BAD: {"type": "string"}}}}}]}, f"tools.0.function.parameters.properties.{BAD}"),
    ("/v1/chat/completions", {"messages": MSG, "stop": BAD}, "stop"),
    ("/v1/chat/completions", {"messages": MSG, "stop": ["ok", BAD]}, "stop.1"),
    ("/v1/chat/completions", {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "description": BAD}}}}, "response_format.json_schema.schema.description"),
    ("/v1/chat/completions", {"messages": [*MSG, {"role": "assistant", "tool_calls": [{
        "id": "c1", "type": "function", "function": {"name": "get_quote", "arguments": json.dumps({"t": BAD})}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"}]}, "messages.1.tool_calls.0.function.arguments"),
    ("/v1/chat/completions", {"messages": MSG, "tool_choice": {"type": "function", "function": {"name": BAD}}},
     "tool_choice.function.name"),
    ("/v1/chat/completions", {"messages": MSG, "response_format": {"type": "sql", "sql": {"tables": {BAD: ["a"]}}}},
     f"response_format.sql.tables.{BAD}"),
    ("/v1/completions", {"prompt": BAD}, "prompt"),
    ("/v1/completions", {"prompt": "x", "suffix": BAD}, "suffix"),
])
def test_lone_surrogates_are_400_naming_the_field(gateway_server, path, body, param):
    r = _post(gateway_server, {"model": "moegate-demo", "max_tokens": 2, **body}, path)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_unicode" and error["param"] == param and "surrogate" in error["message"]


def test_valid_astral_text_is_served(gateway_server):
    r = _post(gateway_server, {"model": "moegate-demo", "max_tokens": 2, "stop": ["\U0001f600"],
                               "messages": [{"role": "user", "content": "price in \U0001f4b6 \u00e9"}]})
    assert r.status_code == 200, r.text


def test_oversized_chunked_body_is_413(gateway_server):
    limit = gateway_server.state.settings.max_request_bytes
    payload = json.dumps({"model": "moegate-demo", "messages": [{"role": "user", "content": "x" * (limit + 10)}]})

    def chunks():
        data = payload.encode()
        for i in range(0, len(data), 16_384):
            yield data[i:i + 16_384]

    r = httpx.post(gateway_server.url + "/v1/chat/completions", content=chunks(), timeout=60,
                   headers={"Authorization": f"Bearer {gateway_server.key_alpha}", "Content-Type": "application/json"})
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "request_too_large" and str(limit) in r.json()["error"]["message"]
    small = json.dumps({"model": "moegate-demo", "messages": MSG, "max_tokens": 2}).encode()
    r = httpx.post(gateway_server.url + "/v1/chat/completions", content=iter([small[:10], small[10:]]), timeout=60,
                   headers={"Authorization": f"Bearer {gateway_server.key_alpha}", "Content-Type": "application/json"})
    assert r.status_code == 200, r.text  # a chunked body within the limit is served


BASES = [
    {"model": "moegate-demo", "max_tokens": 2, "user": "u", "stop": ["x", "y"], "tools": [TOOL],
     "messages": [{"role": "system", "content": "s", "name": "n"},
                  {"role": "user", "content": [{"type": "text", "text": "t"}]},
                  {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
                      "name": "get_quote", "arguments": '{"t": "AAPL"}'}}]},
                  {"role": "tool", "tool_call_id": "c1", "content": "1"}]},
    {"model": "moegate-demo", "max_tokens": 2, "messages": MSG, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "description": "d", "schema": {
            "type": "object", "description": "o", "properties": {"a": {"type": "string", "enum": ["p", "q"]}}}}}},
]


def _string_slots(value, path=()):
    """Every place a string sits in a JSON value: ("value", path) and ("key", path) entries."""
    if isinstance(value, str):
        yield "value", path
    elif isinstance(value, dict):
        for k, v in value.items():
            yield "key", (*path, k)
            yield from _string_slots(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _string_slots(v, (*path, i))


def _replaced(body, kind, path, text):
    body = json.loads(json.dumps(body))
    *parents, last = path
    holder = body
    for p in parents:
        holder = holder[p]
    if kind == "value":
        holder[last] = text
    else:
        holder[text] = holder.pop(last)
    return body


SLOTS = [(i, kind, path) for i, base in enumerate(BASES) for kind, path in _string_slots(base)]


def test_any_text_anywhere_is_answered_without_a_5xx_and_recorded_once(gateway_server):
    """Any code points (unpaired surrogates, controls, astral, NUL) in any string or key of a request."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    odd = st.text(st.characters(codec=None, exclude_categories=()), max_size=6) | st.sampled_from(
        ["\ud800", "\udfff", "a\ud83d", "\x00", "\U0010ffff", "\ufeff"])

    @settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(slot=st.sampled_from(SLOTS), text=odd)
    def probe(slot, text):
        i, kind, path = slot
        body = _replaced(BASES[i], kind, path, text)
        before = len(gateway_server.audit_records())
        r = _post(gateway_server, body)
        assert r.status_code < 500, (path, kind, repr(text), r.text[-300:])
        assert r.status_code in (200, 400, 404, 413), (path, kind, repr(text), r.text[-300:])
        if r.status_code != 200:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert len(gateway_server.audit_records()) == before + 1

    probe()
