"""Tool calls through the gateway in each family's format: a random DeepSeek-V3 (V3.1 calls), DeepSeek-V2
(V3's fenced calls), GPT-OSS, GLM-4.5 and Kimi-K2 checkpoint whose tokenizer holds the family's special tokens, served,
asked with the `openai` client."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine.archs import ALIASES
from gateway.structured.tool_formats import get_format
from tests.gateway.conftest import POLICY, Server, free_port, serve_in_thread
from tests.gateway.tool_format_checkpoint import family_checkpoint

FAMILIES = {"deepseek_v3": "deepseek_v31", "deepseek_v2": "deepseek_v3", "gpt_oss": "harmony", "glm4_moe": "glm45",
            "kimi_k2": "kimi_k2"}
TOOLS = [
    {"type": "function", "function": {"name": "get_quote", "description": "Latest price of a ticker", "parameters": {
        "type": "object", "properties": {"symbol": {"type": "string", "enum": ["AAPL", "MSFT", "NVDA"]}},
        "required": ["symbol"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "place_order", "description": "Send an order", "parameters": {
        "type": "object", "properties": {
            "symbol": {"type": "string", "maxLength": 5}, "side": {"enum": ["buy", "sell"]},
            "qty": {"type": "integer", "minimum": 1, "maximum": 500}},
        "required": ["symbol", "side", "qty"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "system", "content": "You trade for the desk."}, {"role": "user", "content": "Buy 5 AAPL."}]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_server(request, tiny_checkpoint, tmp_path_factory):
    from gateway.settings import Settings

    arch = request.param
    tmp = tmp_path_factory.mktemp(f"tools-{arch}")
    # Kimi-K2: a DeepSeek-V3 checkpoint under its own model_type, whose format config.json's model_type picks
    model = family_checkpoint(tiny_checkpoint(ALIASES.get(arch, arch)), tmp / "model", get_format(FAMILIES[arch]),
                              model_type=arch)
    (tmp / "policy.yaml").write_text(POLICY)
    settings = Settings(model=str(model), policy_path=str(tmp / "policy.yaml"), port=free_port(), device="cpu",
                        kv_cache_gib=0.05, max_queue=3, request_timeout_s=120, state_dir=tmp / "state",
                        otlp_endpoint=None)
    server, thread, app, url = serve_in_thread(settings)
    yield arch, Server(url, app, tmp / "state")
    server.should_exit = True
    thread.join(30)


def _check_calls(message, names=None):
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in (names or SCHEMAS)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_the_family_format_is_selected(family_server):
    arch, server = family_server
    assert server.state.generator.tool_format.name == FAMILIES[arch]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "place_order"}}])
def test_forced_tool_call_parses_with_schema_valid_arguments(family_server, choice):
    _, server = family_server
    r = server.client().chat.completions.create(model="moegate-demo", messages=MESSAGES, tools=TOOLS,
                                                tool_choice=choice, max_tokens=96, temperature=0)
    assert r.choices[0].finish_reason == "tool_calls"
    _check_calls(r.choices[0].message, ["place_order"] if isinstance(choice, dict) else None)
    decisions = r.model_extra["moegate"]["choices"][0]["decisions"]
    assert decisions[0]["mode"] == "execution"  # constrained decoding in the exact mode, as for Qwen


def test_a_history_with_calls_and_results_renders_and_answers(family_server):
    """The family's template takes the whole agent loop (a call, its result) and the next call parses."""
    _, server = family_server
    history = [*MESSAGES,
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                   "name": "get_quote", "arguments": json.dumps({"symbol": "AAPL"})}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "187.25"}]
    r = server.client().chat.completions.create(model="moegate-demo", messages=history, tools=TOOLS,
                                                tool_choice="required", max_tokens=96, temperature=0)
    _check_calls(r.choices[0].message)


def test_auto_calls_open_on_the_family_token(family_server):
    """tool_choice auto: DeepSeek's and GLM's calls are segments opened by their own token (biased here so
    the random model opens one); GPT-OSS's turn is constrained whole (harmony has no single opening token)."""
    arch, server = family_server
    gen = server.state.generator
    bias = {str(gen.tool_open): 100} if gen.tool_open is not None else None
    r = server.client().chat.completions.create(model="moegate-demo", messages=MESSAGES, tools=TOOLS,
                                                max_tokens=96, temperature=0, logit_bias=bias)
    decisions = r.model_extra["moegate"]["choices"][0]["decisions"]
    if arch == "gpt_oss":
        assert (decisions[0]["mode"], decisions[0]["reason"]) == ("execution", "tool_format:harmony")
        message = r.choices[0].message
        if message.tool_calls:
            _check_calls(message)
        else:  # the final channel's text only: no analysis, no harmony tokens
            assert "<|" not in message.content
        return
    assert decisions[0]["mode"] == "exploration"
    assert [d["segment"] for d in decisions[1:3]] == ["tool_call", "tool_call"], decisions
    assert r.choices[0].finish_reason == "tool_calls"
    _check_calls(r.choices[0].message)


def test_streamed_tool_call(family_server):
    _, server = family_server
    stream = server.client().chat.completions.create(model="moegate-demo", messages=MESSAGES, tools=TOOLS,
                                                     tool_choice="required", max_tokens=96, temperature=0,
                                                     stream=True)
    names, args, finish = {}, {}, None
    for chunk in stream:
        choice = chunk.choices[0]
        for d in choice.delta.tool_calls or []:
            names[d.index] = names.get(d.index, "") + (d.function.name or "")
            args[d.index] = args.get(d.index, "") + (d.function.arguments or "")
        finish = choice.finish_reason or finish
    assert finish == "tool_calls" and names
    for i, name in names.items():
        jsonschema.validate(json.loads(args[i]), SCHEMAS[name])


def test_tool_format_setting_names_a_known_format(tiny_checkpoint, tmp_path):
    from gateway.settings import Settings
    from gateway.structured.tool_formats import ToolFormatError

    with pytest.raises(ToolFormatError, match="known: "):
        Settings(model=str(tiny_checkpoint()), state_dir=tmp_path, tool_format="mistral")
    assert Settings(model=str(tiny_checkpoint()), state_dir=tmp_path, tool_format="glm45").tool_format == "glm45"
