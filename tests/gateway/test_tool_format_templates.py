"""Each family's chat template renders a known agent conversation (tools, a call, its result) as the family's
real template does; the expected prompts are written out by hand from those templates."""

from __future__ import annotations

import datetime
import json

import pytest

from engine.archs import ALIASES
from engine.chat_template import ChatTemplateError, render_chat_template
from engine.tokenizer import Tokenizer
from gateway.structured.tool_formats import get_format
from tests.gateway.tool_format_checkpoint import family_checkpoint

TOOLS = [{"type": "function", "function": {"name": "get_quote", "description": "Latest price", "parameters": {
    "type": "object", "properties": {"symbol": {"type": "string", "description": "Ticker"}, "n": {"type": "integer"}},
    "required": ["symbol"]}}}]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "AAPL?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_quote", "arguments": {"symbol": "AAPL"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "187.25"},
]
TOOLS_JSON = ('{"type": "function", "function": {"name": "get_quote", "description": "Latest price", "parameters": '
              '{"type": "object", "properties": {"symbol": {"type": "string", "description": "Ticker"}, "n": '
              '{"type": "integer"}}, "required": ["symbol"]}}}')
BOS, EOS = "<\uff5cbegin\u2581of\u2581sentence\uff5c>", "<\uff5cend\u2581of\u2581sentence\uff5c>"
U, A = "<\uff5cUser\uff5c>", "<\uff5cAssistant\uff5c>"
CALLS_B, CALLS_E = "<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5ctool\u2581calls\u2581end\uff5c>"
CALL_B, CALL_E, SEP = "<\uff5ctool\u2581call\u2581begin\uff5c>", "<\uff5ctool\u2581call\u2581end\uff5c>", "<\uff5ctool\u2581sep\uff5c>"
OUT_B, OUT_E = "<\uff5ctool\u2581output\u2581begin\uff5c>", "<\uff5ctool\u2581output\u2581end\uff5c>"

DEEPSEEK = (
    BOS + "Be brief.\n\n## Tools\nYou have access to the following tools:\n\n### get_quote\nDescription: Latest price"
    '\n\nParameters: {"type": "object", "properties": {"symbol": {"type": "string", "description": "Ticker"}, "n": '
    '{"type": "integer"}}, "required": ["symbol"]}\n\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\n'
    f"{CALLS_B}{CALL_B}tool_call_name{SEP}tool_call_arguments{CALL_E}{{{{additional_tool_calls}}}}{CALLS_E}\n\nWhere:\n\n"
    "- `tool_call_name` must be an exact match to one of the available tools\n"
    "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
    "- For multiple tool calls, chain them directly without separators or spaces\n"
    f"{U}AAPL?{A}</think>{CALLS_B}{CALL_B}get_quote{SEP}{{\"symbol\": \"AAPL\"}}{CALL_E}{CALLS_E}{EOS}"
    f"{OUT_B}187.25{OUT_E}")  # after a tool result the reply continues: no generation prompt

HARMONY = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\nCurrent date: {date}\n\nReasoning: medium\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.\n"
    "Calls to these tools must go to the commentary channel: 'functions'.<|end|>"
    "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\nnamespace functions {\n\n"
    "// Latest price\ntype get_quote = (_: {\n// Ticker\nsymbol: string,\nn?: number,\n}) => any;\n\n"
    "} // namespace functions<|end|>"
    "<|start|>user<|message|>AAPL?<|end|>"
    '<|start|>assistant to=functions.get_quote<|channel|>commentary json<|message|>{"symbol": "AAPL"}<|call|>'
    '<|start|>functions.get_quote to=assistant<|channel|>commentary<|message|>"187.25"<|end|>'
    "<|start|>assistant")

GLM = (
    "[gMASK]<sop><|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n" + TOOLS_JSON + "\n"
    "</tools>\n\nFor each function call, output the function name and arguments within the following XML format:\n"
    "<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n"
    "<arg_key>{arg-key-2}</arg_key>\n<arg_value>{arg-value-2}</arg_value>\n...\n</tool_call>"
    "<|system|>\nBe brief.<|user|>\nAAPL?<|assistant|>\n<think></think>\n"
    "<tool_call>get_quote\n<arg_key>symbol</arg_key>\n<arg_value>AAPL</arg_value>\n</tool_call>"
    "<|observation|>\n<tool_response>\n187.25\n</tool_response><|assistant|>")

QWEN = (
    "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n" + TOOLS_JSON + "\n</tools>"
    "\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nAAPL?<|im_end|>\n"
    '<|im_start|>assistant\n<tool_call>\n{"name": "get_quote", "arguments": {"symbol": "AAPL"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\n187.25\n</tool_response><|im_end|>\n<|im_start|>assistant\n")

KIMI = (
    "<|im_system|>tool_declare<|im_middle|>" + json.dumps(json.loads("[" + TOOLS_JSON + "]"), separators=(",", ":"))
    + "<|im_end|><|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>AAPL?<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|><|tool_calls_section_begin|><|tool_call_begin|>functions.get_quote:0"
    '<|tool_call_argument_begin|>{"symbol": "AAPL"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
    "<|im_system|>tool<|im_middle|>## Return of functions.get_quote:0\n187.25<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|>")

EXPECTED = {"deepseek_v31": DEEPSEEK, "harmony": HARMONY, "glm45": GLM, "qwen": QWEN, "kimi_k2": KIMI}
OUTS_B, OUTS_E = "<\uff5ctool\u2581outputs\u2581begin\uff5c>", "<\uff5ctool\u2581outputs\u2581end\uff5c>"


def _expected(name: str) -> set[str]:
    # harmony states today's date: accept the day before too, should the render cross midnight
    today = datetime.date.today()
    return {EXPECTED[name].replace("{date}", str(d)) for d in (today, today - datetime.timedelta(days=1))}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_family_template_renders_the_known_conversation(name):
    fmt = get_format(name)
    prompt = render_chat_template(fmt.chat_template(), CONVERSATION, tools=TOOLS, special_tokens={"bos_token": BOS})
    assert prompt in _expected(name)


def test_deepseek_v3_parallel_calls_results_and_reply():
    """DeepSeek-V3's fenced calls one a line, results wrapped in tool-outputs, the reply right after them."""
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "get_quote", "arguments": {"symbol": s}}}
             for i, s in enumerate(("AAPL", "MSFT"))]
    conv = [{"role": "user", "content": "Both?"}, {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "content": "187"}, {"role": "tool", "content": "402"},
            {"role": "assistant", "content": "187 and 402."}, {"role": "user", "content": "Thanks"}]
    fenced = "function" + SEP + 'get_quote\n```json\n{{"symbol": "{}"}}\n```'
    expected = (f"{BOS}{U}Both?{A}{CALLS_B}{CALL_B}{fenced.format('AAPL')}{CALL_E}\n{CALL_B}{fenced.format('MSFT')}"
                f"{CALL_E}{CALLS_E}{EOS}{OUTS_B}{OUT_B}187{OUT_E}\n{OUT_B}402{OUT_E}{OUTS_E}187 and 402.{EOS}"
                f"{U}Thanks{A}")
    assert render_chat_template(get_format("deepseek_v3").chat_template(), conv,
                                special_tokens={"bos_token": BOS}) == expected


def test_string_arguments_render_as_given():
    """OpenAI sends arguments as a JSON string: DeepSeek and harmony write it verbatim, GLM needs the object."""
    conv = [*CONVERSATION[:2], {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
            "function": {"name": "get_quote", "arguments": '{"symbol":"MSFT"}'}}]}]
    for name in ("deepseek_v31", "deepseek_v3", "harmony", "kimi_k2"):
        prompt = render_chat_template(get_format(name).chat_template(), conv, tools=TOOLS, add_generation_prompt=False)
        assert '{"symbol":"MSFT"}' in prompt


def test_harmony_refuses_two_calls_in_one_message():
    call = CONVERSATION[2]["tool_calls"][0]
    conv = [*CONVERSATION[:2], {"role": "assistant", "content": None, "tool_calls": [call, call]}]
    with pytest.raises(ChatTemplateError, match="one tool call"):
        render_chat_template(get_format("harmony").chat_template(), conv, tools=TOOLS)


def test_kimi_numbers_calls_across_the_conversation():
    """Kimi-K2 ids count the conversation's calls (functions.NAME:IDX); each result names its call in order."""
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "get_quote", "arguments": {"symbol": s}}}
             for i, s in enumerate(("AAPL", "MSFT"))]
    conv = [{"role": "user", "content": "Both?"}, {"role": "assistant", "content": None, "tool_calls": calls[:1]},
            {"role": "tool", "tool_call_id": "c0", "content": "187"},
            {"role": "assistant", "content": "And MSFT:", "tool_calls": calls[1:]},
            {"role": "tool", "tool_call_id": "c1", "content": "402"}]
    prompt = render_chat_template(get_format("kimi_k2").chat_template(), conv)
    assert prompt.startswith("<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.")
    assert "<|im_middle|>And MSFT:<|tool_calls_section_begin|><|tool_call_begin|>functions.get_quote:1<|" in prompt
    assert prompt.index("## Return of functions.get_quote:0\n187") < prompt.index("## Return of functions.get_quote:1\n402")


@pytest.mark.parametrize("arch, name", [("deepseek_v3", "deepseek_v31"), ("gpt_oss", "harmony"), ("glm4_moe", "glm45"),
                                        ("kimi_k2", "kimi_k2")])
def test_family_tokens_are_single_tokens_of_the_checkpoint(arch, name, tiny_checkpoint, tmp_path):
    """The checkpoint's tokenizer renders the family template and encodes each of its tokens as one id."""
    fmt = get_format(name)
    base = tiny_checkpoint(ALIASES.get(arch, arch))  # Kimi-K2: a DeepSeek-V3 checkpoint under its own model_type
    tok = Tokenizer.from_dir(family_checkpoint(base, tmp_path / "m", fmt, model_type=arch))
    prompt = tok.apply_chat_template(CONVERSATION, tools=TOOLS)
    ids = tok.encode(prompt)
    used = [t for t in fmt.tokens if t in prompt]
    assert len(used) >= 4
    for t in used:
        assert tok.token_to_id(t) in ids and tok.encode(t) == [tok.token_to_id(t)]
    assert tok.decode(ids) == prompt
    assert [tok.id_to_token(i) for i in tok.eos_token_ids[:len(fmt.eos)]] == list(fmt.eos)
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == arch


def test_deepseek_templates_get_arguments_as_json_text():
    """DeepSeek's own templates concatenate a past call's arguments as a string: the gateway hands them the
    JSON text, the others an object; a template that fails on the other type is a ChatTemplateError (a 400)."""
    from gateway.routers.chat import _prompt_messages
    from gateway.schemas import ChatCompletionRequest

    body = ChatCompletionRequest(model="m", messages=[
        {"role": "user", "content": "AAPL?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_quote", "arguments": '{"symbol": "AAPL"}'}}]}])
    v3_style = ("{% for m in messages %}{% for t in m.tool_calls or [] %}{{ t['type'] + '<sep>' + t['function']['name']"
                " + '\\n```json\\n' + t['function']['arguments'] + '\\n```' }}{% endfor %}{% endfor %}")
    messages = _prompt_messages(body, get_format("deepseek_v3"))
    assert render_chat_template(v3_style, messages) == 'function<sep>get_quote\n```json\n{"symbol": "AAPL"}\n```'
    assert _prompt_messages(body, get_format("glm45"))[1]["tool_calls"][0]["function"]["arguments"] == {"symbol": "AAPL"}
    with pytest.raises(ChatTemplateError, match="chat template failed"):
        render_chat_template(v3_style, _prompt_messages(body, get_format("harmony")))


def test_harmony_keeps_the_analysis_before_a_call_until_a_final_reply():
    """As gpt-oss's template: an assistant turn's `thinking` is rendered before its call while no final reply
    follows; once one does, the older analysis is dropped."""
    call = {**CONVERSATION[2], "thinking": "Need the quote."}
    conv = [*CONVERSATION[:2], call, CONVERSATION[3]]
    analysis = "<|start|>assistant<|channel|>analysis<|message|>Need the quote.<|end|><|start|>assistant to=functions"
    fmt = get_format("harmony")
    assert analysis in render_chat_template(fmt.chat_template(), conv, tools=TOOLS)
    later = [*conv, {"role": "assistant", "content": "187.25."}, {"role": "user", "content": "And MSFT?"}]
    prompt = render_chat_template(fmt.chat_template(), later, tools=TOOLS)
    assert "Need the quote." not in prompt and "<|channel|>final<|message|>187.25.<|end|>" in prompt
