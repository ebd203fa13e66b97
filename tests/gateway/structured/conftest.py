"""A small byte-level BPE tokenizer (Qwen-style special tokens) trained once per session."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]

_CORPUS = [
    '{"order_id": "ORD-1042", "symbol": "AAPL", "side": "buy", "quantity": 150, "price": 187.25}',
    '{"positions": [{"symbol": "MSFT", "qty": -20, "avg_cost": 402.1}], "as_of": "2024-05-01"}',
    '{"portfolio": "alpha", "var_95": 1250000.5, "expected_shortfall": 1800000, "breaches": []}',
    "SELECT symbol, SUM(quantity) AS total FROM orders WHERE side = 'buy' GROUP BY symbol LIMIT 10",
    "SELECT T1.name FROM accounts AS T1 JOIN trades AS T2 ON T1.id = T2.account_id ORDER BY T2.ts DESC",
    "The quick brown fox jumps over the lazy dog while markets close higher on strong earnings.",
    "get_quote get_price place_order cancel_order account risk limit currency USD EUR GBP JPY",
    "true false null 0123456789 -+.eE {}[]:,\"' \n\t () * = < > ! ; _ @ # $ % & / \\ | ~ ^ ?",
]


@pytest.fixture(scope="session")
def tokenizer_path(tmp_path_factory) -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=3000, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 50, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return str(path)


@pytest.fixture(scope="session")
def tokinfo(tokenizer_path):
    from gateway.structured.vocab import TokenizerInfo

    tok = Tokenizer.from_file(tokenizer_path)
    return TokenizerInfo.from_file(tokenizer_path, [tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")])
