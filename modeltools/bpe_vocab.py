"""A small byte-level BPE vocabulary trained on generated text, with the ChatML/tool special tokens."""

from __future__ import annotations

import json
import random
from functools import lru_cache

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from tokenizers import normalizers as tk_normalizers

from modeltools.qwen_vocab import QWEN_PRETOKENIZE_REGEX

# (content, special): the same strings and flags as Qwen's, in this order after the BPE vocabulary.
BPE_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

_WORDS = (
    "the a of to and in is for on with as by at from that this it be are was will not or an which "
    "revenue earnings margin growth quarter fiscal year guidance forecast analyst rating price target "
    "stock share bond yield rate inflation dividend cash flow debt equity market index volume close "
    "open high low return risk portfolio allocation hedge option future swap spread basis point "
    "company bank fund investor report filing balance sheet income statement net gross operating "
    "total assets liabilities capital ratio increase decrease compared previous period million billion "
    "user assistant system tool function call arguments name description parameters type object "
    "string number integer boolean array properties required query result error status ok true false "
    "null select from where group by order limit join on as count sum avg max min table column date "
    "ticker symbol currency amount value percent change time zone exchange USD EUR JPY GBP CHF "
    "please show me get compute list find what how much why when latest today yesterday week month"
).split()
_UNICODE_BITS = ("€", "£", "¥", "→", "≈", "±", "µ", "é", "ü", "ß", "株価", "日本", "市場", "金利", "—", "…", "🙂", "📈")
_TICKERS = ("AAPL", "MSFT", "NVDA", "AMZN", "GOOGL", "JPM", "TSLA", "BRK.B", "7203.T", "SAP.DE")


def _sentence(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.45:
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.5:
            words[0] = words[0].capitalize()
        return " ".join(words) + rng.choice([".", ".", "?", "!", ":", ","])
    if kind < 0.65:
        return (f"{rng.choice(_TICKERS)} closed at {rng.choice(['$', '€', '¥', ''])}"
                f"{rng.uniform(1, 5000):,.2f} ({rng.uniform(-9, 9):+.2f}%) on "
                f"{rng.randint(1990, 2030)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}.")
    if kind < 0.85:
        args = {rng.choice(_WORDS): rng.choice([rng.randint(0, 10_000), rng.choice(_TICKERS), rng.random() < 0.5,
                                                 round(rng.uniform(-100, 100), 3), None])
                for _ in range(rng.randint(1, 4))}
        call = json.dumps({"name": "_".join(rng.sample(_WORDS, 2)), "arguments": args}, ensure_ascii=False)
        return f"<tool_call>\n{call}\n</tool_call>" if rng.random() < 0.5 else call
    if kind < 0.93:
        return (f"SELECT {rng.choice(_WORDS)}, SUM({rng.choice(_WORDS)}) FROM {rng.choice(_WORDS)}s "
                f"WHERE {rng.choice(_WORDS)} > {rng.randint(0, 999)} GROUP BY 1 LIMIT {rng.randint(1, 100)};")
    return " ".join(rng.choice(_UNICODE_BITS) + rng.choice(_WORDS) for _ in range(rng.randint(2, 6)))


def training_corpus(n_lines: int = 6000, seed: int = 0) -> list[str]:
    """Deterministic text: prose, prices, JSON tool calls, SQL and some non-ASCII."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        line = " ".join(_sentence(rng) for _ in range(rng.randint(1, 3)))
        lines.append(line + rng.choice(["\n", "\n", "\n\n", "  \n", "\t"]))
    return lines


def byte_level_bpe(pretokenize_regex: str = QWEN_PRETOKENIZE_REGEX) -> Tokenizer:
    """An untrained byte-level BPE with Qwen2's normalizer, pre-tokenizer split (or `pretokenize_regex`) and decoder."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = tk_normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pretokenize_regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


@lru_cache(maxsize=4)
def small_bpe_tokenizer_json(bpe_size: int = 2048) -> str:
    """tokenizer.json text: byte-level BPE with `bpe_size` learned tokens, then the added tokens."""
    tok = byte_level_bpe()
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_size, min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[],
    )
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    data = json.loads(tok.to_str())
    n = tok.get_vocab_size()
    data["added_tokens"] = [
        {"id": n + i, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": special}
        for i, (content, special) in enumerate(BPE_ADDED_TOKENS)
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    data["post_processor"] = byte_level
    data["decoder"] = byte_level
    return json.dumps(data, ensure_ascii=False)
