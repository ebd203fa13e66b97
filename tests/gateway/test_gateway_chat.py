"""The official openai client against a real server: chat, streaming, completions, models, metrics."""

from __future__ import annotations

import re

import httpx


def test_models_and_health(gateway_server):
    client = gateway_server.client()
    models = client.models.list()
    assert [m.id for m in models.data] == ["moegate-demo"]
    assert models.data[0].object == "model"
    assert client.models.retrieve("moegate-demo").id == "moegate-demo"
    health = httpx.get(gateway_server.url + "/health").json()
    assert health["status"] == "ok" and health["system_fingerprint"].startswith("fp_")


def test_chat_non_stream_protocol_and_seed(gateway_server):
    client = gateway_server.client()
    kw = dict(model="moegate-demo", messages=[{"role": "system", "content": "be brief"},
                                              {"role": "user", "content": "hello"}],
              max_tokens=6, temperature=0.9, seed=7)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert a.object == "chat.completion" and a.id.startswith("chatcmpl-")
    assert a.choices[0].message.role == "assistant"
    assert a.choices[0].finish_reason in ("stop", "length")
    assert a.usage.completion_tokens <= 6 and a.usage.prompt_tokens > 0
    assert a.usage.total_tokens == a.usage.prompt_tokens + a.usage.completion_tokens
    assert a.system_fingerprint == gateway_server.state.fingerprints["exploration"]
    assert a.system_fingerprint == gateway_server.state.llm.numerics_fingerprint("exploration")
    assert a.choices[0].message.content == b.choices[0].message.content  # same seed, same text
    decisions = a.model_extra["moegate"]["choices"][0]["decisions"]
    assert decisions[0]["mode"] == "exploration"


def test_chat_n_choices_and_max_completion_tokens(gateway_server):
    r = gateway_server.client().chat.completions.create(
        model="moegate-demo", messages=[{"role": "user", "content": "two"}], n=2, max_completion_tokens=4,
        temperature=1.0, seed=3)
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    assert r.usage.completion_tokens <= 8


def test_chat_stream_chunks_and_usage(gateway_server):
    client = gateway_server.client()
    stream = client.chat.completions.create(model="moegate-demo", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=8, stream=True, stream_options={"include_usage": True},
                                            temperature=0)
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens <= 8
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    full = client.chat.completions.create(model="moegate-demo", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=8, temperature=0)
    assert text == full.choices[0].message.content  # greedy: streamed == non-streamed


def test_stop_sequence_cuts_free_text(gateway_server):
    client = gateway_server.client()
    base = client.chat.completions.create(model="moegate-demo", messages=[{"role": "user", "content": "s"}],
                                          max_tokens=12, temperature=0)
    text = base.choices[0].message.content
    assert len(text) > 4
    stop = text[3:5]
    cut = client.chat.completions.create(model="moegate-demo", messages=[{"role": "user", "content": "s"}],
                                         max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].message.content == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_completions_endpoint(gateway_server):
    client = gateway_server.client()
    r = client.completions.create(model="moegate-demo", prompt="The market", max_tokens=5, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 5
    chunks = list(client.completions.create(model="moegate-demo", prompt="The market", max_tokens=5,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


def test_metrics_exposed(gateway_server):
    gateway_server.client().chat.completions.create(model="moegate-demo", messages=[{"role": "user", "content": "m"}],
                                                    max_tokens=2)
    text = httpx.get(gateway_server.url + "/metrics").text
    assert 'moegate_requests_total{route="/v1/chat/completions",status="200"}' in text
    assert "moegate_tokens_total" in text and "moegate_requests_by_mode_total" in text
    assert "moegate_engine_sequences" in text and "moegate_prefix_cache{" in text
    steps = dict(re.findall(r'^moegate_engine_steps\{counter="(\w+)"\} (\S+)$', text, re.M))
    assert float(steps["steps"]) >= 2 and float(steps["tokens"]) >= 2 and float(steps["wall_seconds"]) > 0


def test_prefix_cache_hit_reports_cached_tokens_and_changes_no_byte(gateway_server):
    """A repeated execution request is served from the prefix cache (usage.prompt_tokens_details.cached_tokens,
    as OpenAI reports it) and gives the same bytes as the miss before it, streamed or not."""
    client = gateway_server.client()
    words = " ".join(f"row{i} AAPL {100 + i}.5 buy" for i in range(60))  # a prompt of several cache blocks
    kw = dict(model="moegate-demo", messages=[{"role": "user", "content": f"ledger: {words}. Summarise as JSON."}],
              max_tokens=40, temperature=0.7, seed=11, response_format={"type": "json_schema", "json_schema": {
                  "name": "s", "schema": {"type": "object", "properties": {"n": {"type": "integer"}},
                                          "required": ["n"]}}})
    miss = client.chat.completions.create(**kw)
    hit = client.chat.completions.create(**kw)
    assert miss.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < hit.usage.prompt_tokens_details.cached_tokens < hit.usage.prompt_tokens
    assert hit.choices[0].message.content == miss.choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == hit.usage.prompt_tokens_details.cached_tokens
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == miss.choices[0].message.content
