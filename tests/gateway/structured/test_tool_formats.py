"""Each tool-call format: constrained decoding under a random model parses into schema-valid calls; the
parsers on hand-written outputs (several calls, parallel calls, malformed text -> ToolCallParseError)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evals.structured.driver import decode, random_logits
from gateway.structured.build import build_constraint
from gateway.structured.errors import StructuredValidationError, ToolCallParseError
from gateway.structured.tool_formats import FORMATS, ToolFormatError, get_format, kimi, select_format
from gateway.structured.tool_formats.deepseek import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP
from gateway.structured.tools import parse_tool_calls, text_before_tool_calls, tool_call_spec
from gateway.structured.validate import validate_tool_calls
from gateway.structured.vocab import TokenizerInfo
from tests.gateway.tool_format_checkpoint import add_format_tokens

TOOLS = [
    {"type": "function", "function": {"name": "get_quote", "parameters": {
        "type": "object", "properties": {"symbol": {"type": "string", "maxLength": 5}},
        "required": ["symbol"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "place_order", "parameters": {
        "type": "object", "properties": {
            "symbol": {"type": "string", "enum": ["AAPL", "MSFT"]}, "side": {"enum": ["buy", "sell"]},
            "qty": {"type": "integer", "minimum": 1, "maximum": 500}, "note": {"type": "string"}},
        "required": ["symbol", "side", "qty"], "additionalProperties": False}}},
]


@pytest.fixture(scope="module")
def family_tok(tokenizer_path):
    """fmt name -> a TokenizerInfo holding the format's special tokens as single tokens."""
    out = {}
    for fmt in FORMATS.values():
        spec = json.loads(Path(tokenizer_path).read_text(encoding="utf-8"))
        ids = add_format_tokens(spec, fmt)
        out[fmt.name] = TokenizerInfo.from_json(json.dumps(spec), [ids[t] for t in fmt.eos], f"{fmt.name}-tokenizer")
    return out


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "place_order"}}])
def test_random_model_calls_parse_and_validate(name, choice, family_tok):
    fmt, tok = get_format(name), family_tok[name]
    spec = tool_call_spec(TOOLS, tok, choice, parallel_tool_calls=True, fmt=fmt)
    for seed in range(4):
        c = build_constraint(spec, tok, max_tokens=160)
        out = decode(c, random_logits(tok.vocab_size + 8, seed), max_tokens=160)
        assert out.finished, f"{name} seed {seed}: not finished"
        text = tok.decode(out.ids[:-1])
        calls = validate_tool_calls(text, TOOLS, choice, True, fmt)
        assert calls, text
        for call in calls:
            if isinstance(choice, dict):
                assert call["name"] == "place_order"
            if call["name"] == "place_order":
                assert call["arguments"]["side"] in ("buy", "sell") and 1 <= call["arguments"]["qty"] <= 500


def test_deepseek_parallel_calls_and_errors():
    fmt = get_format("deepseek_v31")
    text = (f"Let me look.{CALLS_BEGIN}{CALL_BEGIN}get_quote{SEP}{{\"symbol\": \"AAPL\"}}{CALL_END}"
            f"{CALL_BEGIN}place_order{SEP}{{\"symbol\": \"AAPL\", \"side\": \"buy\", \"qty\": 5}}{CALL_END}{CALLS_END}")
    calls = validate_tool_calls(text, TOOLS, "auto", True, fmt)
    assert calls == [{"name": "get_quote", "arguments": {"symbol": "AAPL"}},
                     {"name": "place_order", "arguments": {"symbol": "AAPL", "side": "buy", "qty": 5}}]
    assert text_before_tool_calls(text, fmt) == "Let me look."
    with pytest.raises(StructuredValidationError, match="parallel_tool_calls is false"):
        validate_tool_calls(text, TOOLS, "auto", False, fmt)
    with pytest.raises(ToolCallParseError, match="not closed"):
        parse_tool_calls(text[:-len(CALLS_END)], TOOLS, fmt)
    with pytest.raises(ToolCallParseError, match="not JSON"):
        parse_tool_calls(f"{CALLS_BEGIN}{CALL_BEGIN}get_quote{SEP}{{\"symbol\": {CALL_END}{CALLS_END}", TOOLS, fmt)
    fenced = get_format("deepseek_v3")
    v3 = (f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_quote\n```json\n{{\"symbol\": \"MSFT\"}}\n```{CALL_END}\n"
          f"{CALL_BEGIN}function{SEP}get_quote\n```json\n{{\"symbol\": \"AAPL\"}}\n```{CALL_END}{CALLS_END}")
    assert [c["arguments"]["symbol"] for c in parse_tool_calls(v3, TOOLS, fenced)] == ["MSFT", "AAPL"]
    with pytest.raises(ToolCallParseError, match="fence"):
        parse_tool_calls(v3.replace("```json\n", "", 1), TOOLS, fenced)


def test_harmony_channels_and_errors():
    fmt = get_format("harmony")
    text = ("<|channel|>analysis<|message|>Need a quote.<|end|><|start|>assistant"
            "<|channel|>commentary to=functions.get_quote <|constrain|>json<|message|>{\"symbol\": \"AAPL\"}")
    assert parse_tool_calls(text, TOOLS, fmt) == [{"name": "get_quote", "arguments": {"symbol": "AAPL"}}]
    assert text_before_tool_calls(text, fmt) == ""  # analysis is reasoning, not content
    # the recipient may also stand in the role part of the header, as the chat template writes history
    history = "<|start|>assistant to=functions.get_quote<|channel|>commentary json<|message|>{\"symbol\": \"MSFT\"}"
    assert parse_tool_calls(history, TOOLS, fmt)[0]["arguments"] == {"symbol": "MSFT"}
    final = "<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>final<|message|>It is 187."
    assert parse_tool_calls(final, TOOLS, fmt) == [] and text_before_tool_calls(final, fmt) == "It is 187."
    with pytest.raises(ToolCallParseError, match="commentary"):
        parse_tool_calls(text.replace("commentary to=", "analysis to="), TOOLS, fmt)
    with pytest.raises(ToolCallParseError, match="not JSON"):
        parse_tool_calls(text.replace('"AAPL"}', '"AAPL"'), TOOLS, fmt)


def test_glm_pairs_types_and_errors():
    fmt = get_format("glm45")
    text = ("Sure.\n<tool_call>place_order\n<arg_key>symbol</arg_key>\n<arg_value>AAPL</arg_value>\n"
            "<arg_key>side</arg_key>\n<arg_value>buy</arg_value>\n<arg_key>qty</arg_key>\n<arg_value>7</arg_value>\n"
            "<arg_key>note</arg_key>\n<arg_value>17</arg_value>\n</tool_call>\n"
            "<tool_call>get_quote\n<arg_key>symbol</arg_key>\n<arg_value>MSFT</arg_value>\n</tool_call>")
    calls = validate_tool_calls(text, TOOLS, "auto", True, fmt)
    # a string-typed argument stays text even when it reads as JSON ("17"); others are JSON (7)
    assert calls[0]["arguments"] == {"symbol": "AAPL", "side": "buy", "qty": 7, "note": "17"}
    assert calls[1] == {"name": "get_quote", "arguments": {"symbol": "MSFT"}}
    assert text_before_tool_calls(text, fmt) == "Sure."
    with pytest.raises(ToolCallParseError, match="not JSON"):
        parse_tool_calls(text.replace("<arg_value>7<", "<arg_value>seven<"), TOOLS, fmt)
    with pytest.raises(ToolCallParseError, match="complete calls"):
        parse_tool_calls(text.rsplit("</tool_call>", 1)[0], TOOLS, fmt)
    with pytest.raises(ToolCallParseError, match="no function name"):
        parse_tool_calls("<tool_call>\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call>", TOOLS, fmt)


def test_selection_by_architecture_tokens_and_override(family_tok):
    assert select_format("deepseek_v3", family_tok["deepseek_v31"])[0].name == "deepseek_v31"
    assert select_format("deepseek_v3", family_tok["deepseek_v31"], "... ```json ...")[0].name == "deepseek_v3"
    assert select_format("gpt_oss", family_tok["harmony"])[0].name == "harmony"
    assert select_format("glm4_moe", family_tok["glm45"])[0].name == "glm45"
    assert select_format("qwen3_moe", family_tok["glm45"])[0].name == "qwen"
    fmt, why = select_format("gpt_oss", family_tok["qwen"])  # a tokenizer without harmony's tokens
    assert fmt.name == "qwen" and "lacks" in why
    assert select_format("qwen3_moe", family_tok["harmony"], override="harmony")[0].name == "harmony"
    with pytest.raises(ToolFormatError, match="lacks"):
        select_format("gpt_oss", family_tok["qwen"], override="harmony")
    with pytest.raises(ToolFormatError, match="known"):
        get_format("mistral")


def test_kimi_parallel_calls_and_errors():
    fmt = get_format("kimi_k2")
    SECTION_BEGIN, SECTION_END, ARGS_BEGIN = kimi.SECTION_BEGIN, kimi.SECTION_END, kimi.ARGS_BEGIN  # noqa: N806
    CALL_BEGIN, CALL_END = kimi.CALL_BEGIN, kimi.CALL_END  # noqa: N806
    text = (f"Checking.{SECTION_BEGIN}{CALL_BEGIN}functions.get_quote:0{ARGS_BEGIN}{{\"symbol\": \"AAPL\"}}{CALL_END}"
            f"{CALL_BEGIN}functions.place_order:1{ARGS_BEGIN}{{\"symbol\": \"AAPL\", \"side\": \"buy\", \"qty\": 5}}"
            f"{CALL_END}{SECTION_END}")
    assert validate_tool_calls(text, TOOLS, "auto", True, fmt) == [
        {"name": "get_quote", "arguments": {"symbol": "AAPL"}},
        {"name": "place_order", "arguments": {"symbol": "AAPL", "side": "buy", "qty": 5}}]
    assert text_before_tool_calls(text, fmt) == "Checking."
    with pytest.raises(StructuredValidationError, match="parallel_tool_calls is false"):
        validate_tool_calls(text, TOOLS, "auto", False, fmt)
    with pytest.raises(ToolCallParseError, match="not closed"):
        parse_tool_calls(text[:-len(SECTION_END)], TOOLS, fmt)
    with pytest.raises(ToolCallParseError, match="functions.NAME:INDEX"):
        parse_tool_calls(f"{SECTION_BEGIN}{CALL_BEGIN}get_quote{ARGS_BEGIN}{{}}{CALL_END}{SECTION_END}", TOOLS, fmt)
    with pytest.raises(ToolCallParseError, match="not JSON"):
        parse_tool_calls(f"{SECTION_BEGIN}{CALL_BEGIN}functions.get_quote:0{ARGS_BEGIN}{{\"symbol\"{CALL_END}"
                         f"{SECTION_END}", TOOLS, fmt)


def test_kimi_k2_checkpoints_get_the_kimi_format(family_tok):
    """config.json's model_type picks it (its architecture is DeepSeek-V3's, whose own format is V3.1's), else
    the tokenizer's Kimi tokens do."""
    assert select_format("kimi_k2", family_tok["kimi_k2"])[0].name == "kimi_k2"
    assert select_format("deepseek_v3", family_tok["deepseek_v31"])[0].name == "deepseek_v31"
    assert select_format("kimi_k2", family_tok["qwen"])[0].name == "qwen"  # no Kimi tokens: the default, said why
    # a Kimi-K2 checkpoint that says deepseek_v3 (a llama.cpp deepseek2 GGUF of it): its tokenizer's tokens decide
    assert select_format("deepseek_v3", family_tok["kimi_k2"])[0].name == "kimi_k2"
