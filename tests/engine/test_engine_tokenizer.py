"""engine.tokenizer: encode/decode, special ids, chat template parity with transformers, streaming."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFRawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from engine.chat_template import ChatTemplateError
from engine.tokenizer import Tokenizer, TokenizerLoadError

MULTIBYTE = "€ 1 234 → 株価 📈 café"
RARE_MULTIBYTE = "₿ ≠ 円安 🦄 Ωmega"  # characters the small BPE never saw: split into byte tokens

TOOLS = [
    {"type": "function", "function": {
        "name": "get_quote", "description": "Last traded price of a ticker (€/$).",
        "parameters": {"type": "object", "properties": {"ticker": {"type": "string"},
                                                        "venue": {"type": "string", "enum": ["XNYS", "XETR"]}},
                       "required": ["ticker"]}}},
    {"type": "function", "function": {
        "name": "run_sql", "description": "Read-only SQL <select> only & nothing else.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}},
]

CONVERSATIONS = {
    "plain": [{"role": "user", "content": "Hello"}],
    "system": [{"role": "system", "content": "You are a careful analyst."},
               {"role": "user", "content": "Summarise 株価 moves in € terms."}],
    "multi_turn": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"},
                   {"role": "user", "content": "and now?"}],
    "tool_calls": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Quote AAPL and SAP"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_quote", "arguments": '{"ticker": "AAPL"}'}},
            {"id": "c2", "type": "function",
             "function": {"name": "get_quote", "arguments": {"ticker": "SAP", "venue": "XETR"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": '{"price": 189.84}'},
        {"role": "tool", "tool_call_id": "c2", "content": '{"price": 171.2, "ccy": "€"}'},
        {"role": "assistant", "content": "AAPL 189.84 USD, SAP 171.20 €."},
    ],
    "content_and_call": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "Let me check.",
         "tool_calls": [{"type": "function", "function": {"name": "run_sql", "arguments": {"query": "SELECT 1"}}}]},
        {"role": "tool", "content": "1"},
    ],
    "content_parts": [{"role": "user", "content": [{"type": "text", "text": "part one, "},
                                                   {"type": "text", "text": "part two"}]}],
    "empty_assistant": [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}],
}


@pytest.fixture(scope="module")
def bpe_dir(tiny_checkpoint) -> Path:
    return tiny_checkpoint("qwen3_moe")


@pytest.fixture(scope="module")
def tok(bpe_dir) -> Tokenizer:
    return Tokenizer.from_dir(bpe_dir)


@pytest.fixture(scope="module")
def hf_tok(bpe_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bpe_dir)


def test_encode_decode_match_transformers(tok, hf_tok):
    texts = [MULTIBYTE, "<|im_start|>user\nhi<|im_end|>\n<tool_call>\n{\"a\": 1}\n</tool_call><|endoftext|>",
             "  two  spaces\n\n\ttab", "AAPL closed at $189.84 (+1.23%) on 2024-03-15.", ""]
    for text in texts:
        ids = tok.encode(text)
        assert ids == hf_tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        assert tok.decode(ids, skip_special_tokens=True) == hf_tok.decode(ids, skip_special_tokens=True)
    assert "<|im_end|>" not in tok.decode(tok.encode(texts[1]), skip_special_tokens=True)
    assert "<tool_call>" in tok.decode(tok.encode(texts[1]), skip_special_tokens=True)  # not special, like Qwen


def test_special_ids_and_vocab(tok, hf_tok):
    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    assert tok.eos_token_ids == [im_end, eot]
    assert tok.pad_token_id == eot
    assert tok.bos_token_id == eot  # tokenizer_config has none; generation_config says <|endoftext|>
    assert tok.vocab_size == len(hf_tok)
    assert tok.id_to_token(tok.token_to_id("<tool_call>")) == "<tool_call>"
    assert tok.token_to_id("no-such-token-xyz") is None
    assert tok.encode("<tool_call>") == [tok.token_to_id("<tool_call>")]
    assert im_end in tok.special_token_ids and tok.token_to_id("<think>") not in tok.special_token_ids


def test_eos_union_with_generation_config(tmp_path, bpe_dir):
    d = tmp_path / "ckpt"
    shutil.copytree(bpe_dir, d)
    eot = Tokenizer.from_dir(d).token_to_id("<|endoftext|>")
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": eot, "pad_token_id": 7}))
    t = Tokenizer.from_dir(d)
    assert t.eos_token_ids == [t.token_to_id("<|im_end|>"), eot]
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, eot, 5]}))
    assert Tokenizer.from_dir(d).eos_token_ids == [t.token_to_id("<|im_end|>"), 5, eot]


def test_fingerprint_is_sha256_of_tokenizer_json(tok, bpe_dir):
    assert tok.fingerprint == hashlib.sha256((bpe_dir / "tokenizer.json").read_bytes()).hexdigest()


def test_missing_tokenizer_json_is_a_clear_error(tmp_path):
    with pytest.raises(TokenizerLoadError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_byte_identical_to_transformers(tok, hf_tok, name, with_tools, add_generation_prompt):
    messages = CONVERSATIONS[name]
    tools = TOOLS if with_tools else None
    ours = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt)
    theirs = hf_tok.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                        tokenize=False)
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt
    assert tok.encode_chat(messages, tools, add_generation_prompt) == hf_tok.encode(ours, add_special_tokens=False)


def test_chat_template_renders_tools_and_calls(tok):
    text = tok.apply_chat_template(CONVERSATIONS["tool_calls"], tools=TOOLS, add_generation_prompt=True)
    assert '<tools>\n{"type": "function", "function": {"name": "get_quote"' in text
    assert "(€/$)" in text and "<select> only & nothing" in text  # tojson keeps non-ASCII, no HTML escaping
    assert '<tool_call>\n{"name": "get_quote", "arguments": {"ticker": "AAPL"}}\n</tool_call>' in text
    assert '{"name": "get_quote", "arguments": {"ticker": "SAP", "venue": "XETR"}}' in text
    assert ('<|im_start|>user\n<tool_response>\n{"price": 189.84}\n</tool_response>\n'
            '<tool_response>\n{"price": 171.2, "ccy": "€"}\n</tool_response><|im_end|>\n') in text


# A template using every environment feature transformers provides.
FEATURE_TEMPLATE = (
    "{{ bos_token or 'NOBOS' }}|{{ eos_token }}|{{ pad_token }}\n"
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
    "{% set ns.n = ns.n + 1 %}{% generation %}[{{ m.role }}]{{ m.content }}{% endgeneration %}\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}|{{ m.thinking }}</think>{% endif %}"
    "{% if loop.index >= 3 %}{% break %}{% endif %}{% endfor %}"
    "{{ ns.n }} {{ tools | tojson(indent=2) }} {{ dict(a=1, b=[1, 2]) | tojson(sort_keys=True) }}\n"
    "{{ custom_var }} {{ strftime_now('%Y') | length }} {{ '<&>' | tojson }}\n"
    "{% if add_generation_prompt %}GEN{% endif %}"
)


def test_chat_template_environment_matches_transformers(tmp_path, bpe_dir):
    from transformers import AutoTokenizer

    d = tmp_path / "ckpt"
    shutil.copytree(bpe_dir, d)
    (d / "chat_template.jinja").write_text(FEATURE_TEMPLATE)  # takes precedence over tokenizer_config's
    ours, theirs = Tokenizer.from_dir(d), AutoTokenizer.from_pretrained(d)
    messages = [{"role": "user", "content": "a"}, {"role": "skip", "content": "b"},
                {"role": "assistant", "content": "c", "reasoning": "why"}, {"role": "user", "content": "d"},
                {"role": "user", "content": "never"}]
    for kwargs in ({"add_generation_prompt": True},
                   {"tools": TOOLS, "custom_var": "€x", "add_generation_prompt": False}):
        a = ours.apply_chat_template(messages, **kwargs)
        b = theirs.apply_chat_template(messages, tokenize=False, **kwargs)
        assert a == b
    assert a.startswith("NOBOS|<|im_end|>|<|endoftext|>\n") and "<think>why|why</think>" in a and "never" not in a


def test_chat_template_raise_exception(tok):
    with pytest.raises(ChatTemplateError, match="unsupported message role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "beep"}])
    with pytest.raises(ChatTemplateError, match="empty"):
        tok.apply_chat_template([])


def _assert_stream_equals_decode(t: Tokenizer, ids: list[int], skip: bool = False) -> list[str]:
    stream = t.stream(skip_special_tokens=skip)
    deltas = [stream.push(i) for i in ids]
    deltas.append(stream.flush())
    assert "".join(deltas) == t.decode(ids, skip_special_tokens=skip)
    return deltas


@pytest.mark.parametrize("text", [MULTIBYTE, RARE_MULTIBYTE])
def test_stream_multibyte_never_splits_characters(tok, text):
    ids = tok.encode(text)
    deltas = _assert_stream_equals_decode(tok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text
    if text == RARE_MULTIBYTE:
        assert len(ids) > len(text)  # characters span several byte-level tokens...
        assert sum(d == "" for d in deltas[:-1]) >= 5  # ...so pushes held back partial characters


def test_stream_random_ids_and_special_tokens(tok):
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 40))]
        _assert_stream_equals_decode(tok, ids)
        _assert_stream_equals_decode(tok, ids, skip=True)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.stream().push(tok.vocab_size)


def test_byte_level_stream_matches_codecs_incremental_decoder():
    """ByteLevelStream's own pending bytes give codecs' incremental UTF-8 decoder's deltas (errors replaced), push by
    push and at the flush: split, invalid and truncated sequences included."""
    import codecs

    from engine.detokenizer import ByteLevelStream

    rng = random.Random(1)
    pieces = ["é".encode(), "€".encode()[:1], "€".encode()[1:], "😀".encode()[:3], "😀".encode()[3:], b"\xf0", b"\xff"]
    token_bytes = [bytes(rng.randrange(256) for _ in range(rng.randint(0, 4))) for _ in range(200)] + pieces + [None]
    for _ in range(500):
        ids = [rng.randrange(len(token_bytes)) for _ in range(rng.randint(1, 30))]
        stream, ref = ByteLevelStream(token_bytes), codecs.getincrementaldecoder("utf-8")(errors="replace")
        for i in ids:
            assert stream.push(i) == ("" if token_bytes[i] is None else ref.decode(token_bytes[i]))
        assert stream.flush() == ref.decode(b"", final=True)


def test_windowed_stream_for_non_byte_level_decoder(tmp_path):
    """A sentencepiece-style vocabulary (Metaspace + byte fallback) goes through the windowed path."""
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    raw = HFRawTokenizer(models.BPE(byte_fallback=True, unk_token=None))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    corpus = ["the market closed higher today", "bonds and stocks", "rates rose by one point"] * 20
    raw.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=byte_tokens,
                                                        show_progress=False))
    (tmp_path / "tokenizer.json").write_text(raw.to_str())
    t = Tokenizer.from_dir(tmp_path)
    ids = t.encode("the 株価 market → €")
    assert any(t.id_to_token(i).startswith("<0x") for i in ids)  # unknown characters fell back to bytes
    deltas = _assert_stream_equals_decode(t, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == "the 株価 market → €"


def test_named_templates_pick_tool_use_like_transformers(tmp_path, bpe_dir):
    from transformers import AutoTokenizer

    d = tmp_path / "ckpt"
    shutil.copytree(bpe_dir, d)
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "DEFAULT {{ messages[0].content }}"},
                               {"name": "tool_use", "template": "TOOLS {{ (tools or []) | length }} {{ messages[0].content }}"}]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    messages = [{"role": "user", "content": "q"}]
    for files in (False, True):
        if files:  # the files saved by transformers 5 take precedence over tokenizer_config
            (d / "chat_template.jinja").write_text("FILE-DEFAULT {{ messages[0].content }}")
            (d / "additional_chat_templates").mkdir()
            (d / "additional_chat_templates" / "tool_use.jinja").write_text("FILE-TOOLS {{ tools | length }}")
        ours, theirs = Tokenizer.from_dir(d), AutoTokenizer.from_pretrained(d)
        for tools in (None, TOOLS):
            a = ours.apply_chat_template(messages, tools=tools)
            assert a == theirs.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
            assert a == {(False, False): "DEFAULT q", (False, True): "TOOLS 2 q",
                         (True, False): "FILE-DEFAULT q", (True, True): "FILE-TOOLS 2"}[files, bool(tools)]
    assert ours.apply_chat_template(messages, chat_template="default") == "FILE-DEFAULT q"


def test_small_bpe_is_deterministic():
    from modeltools.bpe_vocab import BPE_ADDED_TOKENS, small_bpe_tokenizer_json

    first = small_bpe_tokenizer_json(512)
    small_bpe_tokenizer_json.cache_clear()
    assert small_bpe_tokenizer_json(512) == first
    data = json.loads(first)
    assert len(data["model"]["vocab"]) == 512
    assert [t["content"] for t in data["added_tokens"]] == [c for c, _ in BPE_ADDED_TOKENS]
    assert [t["id"] for t in data["added_tokens"]] == list(range(512, 512 + len(BPE_ADDED_TOKENS)))
