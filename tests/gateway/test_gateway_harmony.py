"""GPT-OSS replies through the gateway, asked with the `openai` client: every chat reply of a harmony model is
split by channel (analysis -> `reasoning_content`, final -> `content`), streamed or not, and a json_schema
response is constrained to the final channel."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from gateway.routers.chat import _template_messages
from gateway.schemas import ChatCompletionRequest
from gateway.structured.tool_formats.harmony import CHANNEL, END, HARMONY, MESSAGE, START
from tests.gateway.conftest import POLICY, Server, free_port, serve_in_thread
from tests.gateway.tool_format_checkpoint import family_checkpoint

MESSAGES = [{"role": "system", "content": "You trade for the desk."}, {"role": "user", "content": "Buy 5 AAPL."}]
SCHEMA = {"type": "object", "properties": {"symbol": {"enum": ["AAPL", "MSFT"]},
                                           "qty": {"type": "integer", "minimum": 1, "maximum": 500}},
          "required": ["symbol", "qty"], "additionalProperties": False}


@pytest.fixture(scope="module")
def harmony_server(tiny_checkpoint, tmp_path_factory):
    from gateway.settings import Settings

    tmp = tmp_path_factory.mktemp("harmony")
    model = family_checkpoint(tiny_checkpoint("gpt_oss"), tmp / "model", HARMONY)
    (tmp / "policy.yaml").write_text(POLICY)
    settings = Settings(model=str(model), policy_path=str(tmp / "policy.yaml"), port=free_port(), device="cpu",
                        kv_cache_gib=0.05, max_queue=3, request_timeout_s=120, state_dir=tmp / "state",
                        otlp_endpoint=None)
    server, thread, app, url = serve_in_thread(settings)
    yield Server(url, app, tmp / "state")
    server.should_exit = True
    thread.join(30)


def _bias(server: Server) -> dict[str, float]:
    """Nudges the random model toward harmony's markers: its greedy reply opens with bare <|message|> tokens,
    then text (the split must drop the markers and keep the text)."""
    tok = server.state.generator.tok
    return {str(tok.added_ids[t]): 0.5 for t in (CHANNEL, MESSAGE)}


def _raw(server: Server, bias: dict, max_tokens: int) -> str:
    """The same greedy reply as plain text: /v1/completions on the chat prompt's token ids."""
    tok = server.state.llm.tokenizer
    ids = tok.encode(tok.apply_chat_template(MESSAGES))
    r = server.client().completions.create(model="moegate-demo", prompt=ids, max_tokens=max_tokens, temperature=0,
                                           logit_bias=bias)
    return r.choices[0].text


def test_plain_chat_is_split_by_channel(harmony_server):
    server, bias = harmony_server, _bias(harmony_server)
    raw = _raw(server, bias, 48)
    assert raw.startswith(MESSAGE), raw  # the reply holds harmony markers to drop
    reasoning, content = HARMONY.channels().split(raw)
    assert content and MESSAGE not in content
    r = server.client().chat.completions.create(model="moegate-demo", messages=MESSAGES, max_tokens=48,
                                                temperature=0, logit_bias=bias)
    message = r.choices[0].message
    assert (message.content, getattr(message, "reasoning_content", None) or "") == (content, reasoning)
    for text in (message.content, getattr(message, "reasoning_content", None) or ""):
        for marker in (CHANNEL, MESSAGE, END, START):
            assert marker not in text

    stream = server.client().chat.completions.create(model="moegate-demo", messages=MESSAGES, max_tokens=48,
                                                     temperature=0, logit_bias=bias, stream=True)
    parts = {"content": "", "reasoning_content": ""}
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            parts["content"] += delta.content or ""
            parts["reasoning_content"] += (delta.model_extra or {}).get("reasoning_content") or ""
    assert (parts["content"], parts["reasoning_content"]) == (content, reasoning)


def test_a_reply_with_analysis_and_final_fills_both_fields(harmony_server):
    """json_schema: the grammar opens the turn with an analysis message (biased here) and then the final
    channel, whose text alone is the JSON content; the analysis is `reasoning_content`."""
    server = harmony_server
    tok = server.state.llm.tokenizer
    analysis = tok.encode("analysis")[0]  # the grammar's first choice after <|channel|>: analysis or final
    fmt = {"type": "json_schema", "json_schema": {"name": "order", "schema": SCHEMA}}
    for stream in (False, True):
        kw = dict(model="moegate-demo", messages=MESSAGES, max_tokens=120, temperature=0,
                  logit_bias={str(analysis): 50}, response_format=fmt)
        if stream:
            content, reasoning = "", ""
            for chunk in server.client().chat.completions.create(stream=True, **kw):
                if chunk.choices:
                    content += chunk.choices[0].delta.content or ""
                    reasoning += (chunk.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
        else:
            r = server.client().chat.completions.create(**kw)
            content, reasoning = r.choices[0].message.content, getattr(r.choices[0].message, "reasoning_content", "")
            assert r.model_extra["moegate"]["choices"][0]["validations"][0]["ok"]
        jsonschema.validate(json.loads(content), SCHEMA)
        assert reasoning and "<|" not in reasoning and "<|" not in content, (reasoning, content)


def test_json_schema_without_analysis_is_the_final_channel_only(harmony_server):
    server = harmony_server
    tok = server.state.llm.tokenizer
    final = tok.encode("final")[0]
    fmt = {"type": "json_schema", "json_schema": {"name": "order", "schema": SCHEMA}}
    r = server.client().chat.completions.create(model="moegate-demo", messages=MESSAGES, max_tokens=120,
                                                temperature=0, logit_bias={str(final): 50}, response_format=fmt)
    message = r.choices[0].message
    jsonschema.validate(json.loads(message.content), SCHEMA)
    assert getattr(message, "reasoning_content", None) is None


def test_sql_response_format_is_refused_with_a_reason(harmony_server):
    fmt = {"type": "sql", "sql": {"tables": {"trades": ["id", "symbol"]}}}
    with pytest.raises(openai.BadRequestError, match="not supported for the harmony format"):
        harmony_server.client().chat.completions.create(model="moegate-demo", messages=MESSAGES, max_tokens=32,
                                                        response_format=fmt)


def test_the_agent_loop_sends_the_reply_back_as_the_client_got_it(harmony_server):
    """The openai client appends the response message as it came (reasoning_content included) with the tool's
    result; the next turn is accepted and the template keeps that analysis before the call."""
    server = harmony_server
    analysis = server.state.llm.tokenizer.encode("analysis")[0]
    tools = [{"type": "function", "function": {"name": "get_quote", "parameters": {
        "type": "object", "properties": {"symbol": {"enum": ["AAPL", "MSFT"]}}, "required": ["symbol"]}}}]
    client = server.client()
    r = client.chat.completions.create(model="moegate-demo", messages=MESSAGES, tools=tools, tool_choice="required",
                                       max_tokens=96, temperature=0, logit_bias={str(analysis): 50})
    message = r.choices[0].message
    assert message.tool_calls and message.reasoning_content, message
    history = [*MESSAGES, message, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "187.25"}]
    again = client.chat.completions.create(model="moegate-demo", messages=history, max_tokens=8, temperature=0)
    assert again.choices[0].finish_reason in ("stop", "length")
    tok = server.state.llm.tokenizer
    prompt = tok.apply_chat_template(_template_messages(ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in history]}
    ).messages, HARMONY.arguments_as_text), tools=tools)
    assert (f"<|start|>assistant<|channel|>analysis<|message|>{message.reasoning_content}<|end|>"
            "<|start|>assistant to=functions.get_quote") in prompt
