"""GPT-OSS harmony replies split by channel: hand-written turns fed whole and cut at every character
(analysis -> reasoning, final -> content, calls and headers dropped), and a whole-output JSON Schema
constrained to the final channel under a random model."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from evals.structured.driver import decode, random_logits
from gateway.structured.backend_outlines import OutlinesBackend
from gateway.structured.build import build_constraint, json_schema_spec
from gateway.structured.errors import ConstraintCompileError
from gateway.structured.tool_formats import get_format
from gateway.structured.tool_formats.harmony import HARMONY, HarmonyChannels
from gateway.structured.validate import validate_json
from gateway.structured.vocab import TokenizerInfo
from tests.gateway.tool_format_checkpoint import add_format_tokens

TURNS = [  # (text, reasoning, content)
    ("<|channel|>analysis<|message|>The user wants 5 AAPL.<|end|><|start|>assistant<|channel|>final<|message|>"
     "Bought 5 AAPL at 187.25.", "The user wants 5 AAPL.", "Bought 5 AAPL at 187.25."),
    ("<|channel|>final<|message|>No reasoning, a <|bare|> marker-like text and a < sign.", "",
     "No reasoning, a <|bare|> marker-like text and a < sign."),
    ("<|channel|>analysis<|message|>Check the quote first.<|end|><|start|>assistant<|channel|>commentary "
     "to=functions.get_quote <|constrain|>json<|message|>{\"symbol\": \"AAPL\"}<|call|>", "Check the quote first.", ""),
    ("<|channel|>commentary<|message|>Looking it up.<|end|><|start|>assistant<|channel|>final<|message|>Done",
     "", "Looking it up.Done"),
    ("plain text from a model that writes no header", "", "plain text from a model that writes no header"),
    ("<|channel|>analysis<|message|>cut off in the middle <|en", "cut off in the middle <|en", ""),
]


@pytest.mark.parametrize("text,reasoning,content", TURNS)
def test_whole_turns_split_by_channel(text, reasoning, content):
    assert HARMONY.channels().split(text) == (reasoning, content)
    assert HARMONY.content(text) == content


@pytest.mark.parametrize("text,reasoning,content", TURNS)
def test_streamed_in_two_pieces_at_every_cut(text, reasoning, content):
    """A marker cut between two deltas is held back, never leaked: every cut gives the whole turn's split."""
    for cut in range(len(text) + 1):
        s = HarmonyChannels()
        pieces = s.feed(text[:cut]) + s.feed(text[cut:]) + s.close()
        got = ("".join(t for k, t in pieces if k == "reasoning"), "".join(t for k, t in pieces if k == "content"))
        assert got == (reasoning, content), cut


def test_streamed_character_by_character():
    text, reasoning, content = TURNS[0]
    s = HarmonyChannels()
    pieces = [p for ch in text for p in s.feed(ch)] + s.close()
    assert "".join(t for k, t in pieces if k == "reasoning") == reasoning
    assert "".join(t for k, t in pieces if k == "content") == content


def test_formats_without_channels_keep_the_text():
    for name in ("qwen", "deepseek_v31", "glm45"):
        fmt = get_format(name)
        assert fmt.channels() is None and fmt.content("<think>x</think>y") == "<think>x</think>y"


SCHEMA = {"type": "object", "properties": {"symbol": {"enum": ["AAPL", "MSFT"]},
                                           "qty": {"type": "integer", "minimum": 1, "maximum": 500}},
          "required": ["symbol", "qty"], "additionalProperties": False}


@pytest.fixture(scope="module")
def harmony_tok(tokenizer_path):
    spec = json.loads(Path(tokenizer_path).read_text(encoding="utf-8"))
    ids = add_format_tokens(spec, HARMONY)
    return TokenizerInfo.from_json(json.dumps(spec), [ids[t] for t in HARMONY.eos], "harmony-tokenizer")


def test_json_schema_is_constrained_to_the_final_channel(harmony_tok):
    """Random logits under the envelope: every output is (analysis?) final, and the final channel's text
    is the schema's JSON; the reasoning, when the model wrote one, is apart."""
    tok = harmony_tok
    spec = json_schema_spec(SCHEMA, HARMONY.json_envelope(tok), (tok.added_ids["<|message|>"],))
    for seed in range(6):
        c = build_constraint(spec, tok, max_tokens=120)
        out = decode(c, random_logits(tok.vocab_size + 8, seed), max_tokens=120)
        assert out.finished, seed
        text = tok.decode(out.ids[:-1])
        assert "<|channel|>final<|message|>" in text, text
        _, content = HARMONY.channels().split(text)
        jsonschema.validate(json.loads(content), SCHEMA)
        validate_json(HARMONY.content(text), SCHEMA)
    assert spec.digest != json_schema_spec(SCHEMA).digest  # the envelope is part of the cache key


def test_outlines_refuses_an_envelope(harmony_tok):
    spec = json_schema_spec(SCHEMA, HARMONY.json_envelope(harmony_tok))
    with pytest.raises(ConstraintCompileError, match="envelope"):
        OutlinesBackend().compile(spec, harmony_tok)
