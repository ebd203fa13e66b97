"""Structured outputs through the openai client: tools (auto/required/named/parallel), json_schema strict,
json_object, the SQL extension; every structured output that leaves the server validates."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import sqlglot

QUOTE = {"type": "function", "function": {"name": "get_quote", "description": "latest price", "parameters": {
    "type": "object", "properties": {"symbol": {"type": "string", "maxLength": 6}},
    "required": ["symbol"], "additionalProperties": False}}}
POSITIONS = {"type": "function", "function": {"name": "get_positions", "parameters": {
    "type": "object", "properties": {"desk": {"enum": ["a", "b"]}, "limit": {"type": "integer", "minimum": 1,
                                                                            "maximum": 50}},
    "required": ["desk", "limit"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (QUOTE, POSITIONS)}
ORDER = {"type": "object", "properties": {
    "symbol": {"type": "string", "minLength": 1, "maxLength": 5},
    "side": {"enum": ["buy", "sell"]}, "quantity": {"type": "integer", "minimum": 1, "maximum": 1000}},
    "required": ["symbol", "side", "quantity"], "additionalProperties": False}


def _chat(server, **kw):
    kw.setdefault("messages", [{"role": "user", "content": "get me the quote for AAPL"}])
    return server.client().chat.completions.create(model="moegate-demo", **kw)


def _check_calls(calls, allowed):
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_") and c.function.name in allowed
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_positions"}}])
def test_tool_choice_required_and_named(gateway_server, choice):
    r = _chat(gateway_server, tools=[QUOTE, POSITIONS], tool_choice=choice, max_tokens=64, temperature=0.8, seed=1)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    allowed = {"get_positions"} if isinstance(choice, dict) else {"get_quote", "get_positions"}
    _check_calls(msg.tool_calls, allowed)
    decisions = r.model_extra["moegate"]["choices"][0]["decisions"]
    assert decisions[0]["mode"] == "execution" and decisions[0]["reason"] == "request:tools_required"


def test_parallel_tool_calls_flag(gateway_server):
    # a strong bias on "\n" and <tool_call> makes the model open another call after each one closes
    open_id = gateway_server.state.generator.tool_open
    newline = gateway_server.state.llm.tokenizer.encode("\n")
    kw = dict(tools=[QUOTE, POSITIONS], tool_choice="required", max_tokens=120, temperature=0,
              logit_bias={str(open_id): 100, **{str(t): 50 for t in newline}})
    many = _chat(gateway_server, parallel_tool_calls=True, **kw)
    assert len(many.choices[0].message.tool_calls) >= 2
    _check_calls(many.choices[0].message.tool_calls, {"get_quote", "get_positions"})
    one = _chat(gateway_server, parallel_tool_calls=False, **kw)
    assert len(one.choices[0].message.tool_calls) == 1


def test_tool_choice_auto_in_exploration(gateway_server):
    """auto: free text unless the model opens a tool call, which is then constrained and validated."""
    open_id = gateway_server.state.generator.tool_open
    r = _chat(gateway_server, tools=[QUOTE], max_tokens=48, temperature=0, logit_bias={str(open_id): 100},
              parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "tool_calls"
    _check_calls(r.choices[0].message.tool_calls, {"get_quote"})
    decisions = r.model_extra["moegate"]["choices"][0]["decisions"]
    assert decisions[0]["mode"] == "exploration"
    assert decisions[1] == {"mode": "execution", "reason": "tool_call_start", "token_index": 0,
                            "segment": "tool_call", "engine_applied": True}
    none = _chat(gateway_server, tools=[QUOTE], tool_choice="none", max_tokens=8, temperature=0,
                 logit_bias={str(open_id): 100})
    assert none.choices[0].message.tool_calls is None  # the start token is masked


def test_streamed_tool_call_deltas(gateway_server):
    stream = gateway_server.client().chat.completions.create(
        model="moegate-demo", messages=[{"role": "user", "content": "quote"}], tools=[QUOTE],
        tool_choice="required", max_tokens=48, stream=True, temperature=0)
    chunks = list(stream)
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_quote"
    args = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(args), SCHEMAS["get_quote"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_json_schema_strict(gateway_server):
    for seed in range(3):
        r = _chat(gateway_server, max_tokens=64, temperature=1.0, seed=seed, response_format={
            "type": "json_schema", "json_schema": {"name": "order", "strict": True, "schema": ORDER}})
        jsonschema.validate(json.loads(r.choices[0].message.content), ORDER)
        assert r.choices[0].finish_reason == "stop"
        assert r.model_extra["moegate"]["choices"][0]["validations"][-1]["ok"] is True
        assert r.system_fingerprint == gateway_server.state.llm.numerics_fingerprint("execution")


def test_json_object_and_streamed_json(gateway_server):
    r = _chat(gateway_server, max_tokens=48, temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    chunks = list(gateway_server.client().chat.completions.create(
        model="moegate-demo", messages=[{"role": "user", "content": "order"}], max_tokens=64, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER}}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), ORDER)


def test_unresolvable_schema_reference_is_400(gateway_server):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        _chat(gateway_server, max_tokens=8, response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"$ref": "https://example.com/order.json"}}})
    assert "remote reference" in e.value.message and e.value.code == "unsupported_schema_feature"


def _sql_bias(server, words):
    tok = server.state.llm.tokenizer
    return {str(t): 10 for w in words for t in tok.encode(w)}


def test_sql_extension(gateway_server):
    """response_format type "sql": the caller's tables + the policy database's rules (allowed tables, LIMIT)."""
    tables = {"prices": ["ticker", "price"], "trades": ["ticker", "qty"]}
    bias = _sql_bias(gateway_server, ["SELECT", " ticker", " FROM", " prices"])
    bias.update({str(t): 10 for t in gateway_server.state.llm.engine.eos_token_ids})  # end once the grammar may
    r = _chat(gateway_server, max_tokens=60, temperature=0, logit_bias=bias,
              response_format={"type": "sql", "sql": {"tables": tables, "dialect": "sqlite", "database": "market"}})
    sql = r.choices[0].message.content
    tree = sqlglot.parse_one(sql, read="sqlite")
    assert {t.name.lower() for t in tree.find_all(sqlglot.exp.Table)} <= {"prices"}  # trades: not allowed
    assert int(tree.args["limit"].expression.this) <= 100  # the policy's row_limit
    assert r.model_extra["moegate"]["choices"][0]["decisions"][0]["reason"] == "request:sql"


def test_sql_extension_failure_is_typed(gateway_server):
    """A budget no query fits in (`SELECT` alone is not one): a typed 400 after the strict retry,
    never invalid SQL."""
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        _chat(gateway_server, max_tokens=1, temperature=0, response_format={"type": "sql", "sql": {
            "tables": {"prices": ["ticker", "price"]}, "database": "market"}})
    assert e.value.code in ("sql_policy_violation", "structured_output_invalid")
    metrics = gateway_server.state.metrics.render().decode()
    assert 'moegate_validations_total{kind="sql",result="fail"}' in metrics
    retries = re.search(r"^moegate_strict_retries_total (\S+)$", metrics, re.M)
    assert retries and float(retries.group(1)) >= 1  # the bounded strict retry ran before the error
    # the audit log keeps what was generated: each rejected attempt's text and why it was rejected
    rec = next(r for r in reversed(gateway_server.audit_records()) if r["data"].get("error") == e.value.code)
    attempts = json.loads(rec["data"]["output"])
    assert [a["attempt"] for a in attempts] == [0, 1] and all(a["content"] and a["rejected"] for a in attempts)
    assert [v["ok"] for v in rec["data"]["validations"]] == [False, False]


def test_agent_loop_appends_the_response_message(gateway_server):
    """The usual agent loop: append the returned message as is, then the tool result, and continue."""
    client = gateway_server.client()
    messages = [{"role": "user", "content": "quote AAPL"}]
    first = client.chat.completions.create(model="moegate-demo", messages=messages, tools=[QUOTE],
                                           tool_choice="required", max_tokens=48, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages += [first.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": '{"price": 187.2}'}]
    second = client.chat.completions.create(model="moegate-demo", messages=messages, tools=[QUOTE], max_tokens=4,
                                            tool_choice="none", temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length") and second.choices[0].message.tool_calls is None
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
