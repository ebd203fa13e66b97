"""TokenizerInfo: token bytes, specials and hashes come from tokenizer.json alone (offline)."""

from __future__ import annotations

from tokenizers import Tokenizer

from gateway.structured.vocab import TokenizerInfo


def test_token_bytes_match_the_tokenizer(tokenizer_path, tokinfo):
    hf = Tokenizer.from_file(tokenizer_path)
    assert tokinfo.vocab_size == hf.get_vocab_size(with_added_tokens=True)
    text = 'Buy 150 AAPL @ 187.25 {"side": "sell"} résumé\n\tdone'
    ids = hf.encode(text).ids
    assert b"".join(tokinfo.token_bytes[i] for i in ids).decode() == text
    for name in ("<|endoftext|>", "<|im_end|>", "<tool_call>", "</tool_call>"):
        i = tokinfo.token_id(name)
        assert tokinfo.token_bytes[i] is None and hf.id_to_token(i) == name


def test_hash_depends_on_eos_and_content(tokenizer_path, tokinfo):
    other = TokenizerInfo.from_file(tokenizer_path, [tokinfo.eos_ids[0]])
    assert other.hash != tokinfo.hash
    assert TokenizerInfo.from_file(tokenizer_path, tokinfo.eos_ids) is tokinfo
