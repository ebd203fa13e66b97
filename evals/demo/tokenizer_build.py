"""Train the demo model's byte-level BPE (Qwen2 pre-tokenizer, Qwen special tokens) on the corpus."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, pre_tokenizers, trainers

from evals.demo.chat_format import CHAT_TEMPLATE, SPECIAL_TOKENS
from evals.demo.corpus import conversations
from modeltools.bpe_vocab import byte_level_bpe
from modeltools.qwen_vocab import QWEN_PRETOKENIZE_REGEX

# Qwen2's split, except that an all-capitals word (a ticker, `ACC`, `SELECT`) never takes the space or quote before
# it: ` MSFT` in prose and `MSFT` after a JSON quote are then the same token, so copying a ticker from the user's
# words into a tool call is the identity, as it is for digits. With Qwen2's split they are two unrelated tokens.
_QWEN_WORD = r"[^\r\n\p{L}\p{N}]?\p{L}+"
_DEMO_WORD = r"(?:[^\r\n\p{L}\p{N}](?!\p{Lu}+(?!\p{L})))?\p{L}+"
if _QWEN_WORD not in QWEN_PRETOKENIZE_REGEX:
    raise RuntimeError("Qwen2's pre-tokenizer pattern changed: update _QWEN_WORD")
DEMO_PRETOKENIZE_REGEX = QWEN_PRETOKENIZE_REGEX.replace(_QWEN_WORD, _DEMO_WORD)
# each capital of an all-capitals word as its own piece (`AAPL` is `A`, `A`, `P`, `L`, as `1012` is four digits): a
# whole-ticker token is rare and a model learns to copy it slowly; letters are frequent, like digits. In 330-step pilots
# on brief reports, the first token of a ticker was copied 99/105 with this split against 6/105 without it
# The words of the formats themselves (SQL keywords and types, `JSON`, `XML`) are not entities to copy: they stay
# whole words, so a schema's `NOT NULL` is not eight tokens.
FORMAT_WORDS = ("AND", "AS", "ASC", "AVG", "BETWEEN", "BY", "CASE", "CHECK", "COALESCE", "COUNT", "CREATE", "DESC",
                "DISTINCT", "ELSE", "END", "FROM", "GROUP", "HAVING", "IN", "INNER", "INTEGER", "IS", "JOIN", "JSON",
                "KEY", "LEFT", "LIKE", "LIMIT", "MAX", "MIN", "NOT", "NULL", "ON", "OR", "ORDER", "PRIMARY", "REAL",
                "REFERENCES", "ROUND", "SELECT", "SQL", "SUM", "TABLE", "TEXT", "THEN", "UNIQUE", "WHEN", "WHERE", "XML")
SPLIT_CAPITALS_REGEX = (r"(?<!\p{L})(?:" + "|".join(sorted(FORMAT_WORDS, key=len, reverse=True)) + r")(?!\p{L})|"
                        r"\p{Lu}(?=\p{Lu}*(?!\p{L}))|" + DEMO_PRETOKENIZE_REGEX)


def train_tokenizer(texts: list[str], vocab_size: int, split_capitals: bool = False) -> Tokenizer:
    """A byte-level BPE whose first ids are the special tokens (<|endoftext|> = 0)."""
    tok = byte_level_bpe(SPLIT_CAPITALS_REGEX if split_capitals else DEMO_PRETOKENIZE_REGEX)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


def save_hf_tokenizer(tok: Tokenizer, out_dir: Path) -> None:
    """Write tokenizer.json and a tokenizer_config.json carrying the chat template."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 bos_token=None, unk_token=None, model_max_length=1024,
                                 additional_special_tokens=[t for t in SPECIAL_TOKENS
                                                            if t not in ("<|im_end|>", "<|endoftext|>")])
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(str(out_dir))
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE  # keep it in tokenizer_config.json, not only chat_template.jinja
    config["tokenizer_class"] = "PreTrainedTokenizerFast"  # loadable by transformers 4.x as well as 5.x
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (out_dir / "chat_template.jinja").unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--vocab-size", type=int, default=6144)
    parser.add_argument("--conversations", type=int, default=20_000)
    parser.add_argument("--split-capitals", action=argparse.BooleanOptionalAction, default=False,
                        help="every capital of an all-capitals word (tickers, not SQL keywords) as its own token")
    args = parser.parse_args()
    texts = [c.render() for c in conversations("train", args.conversations)]
    tok = train_tokenizer(texts, args.vocab_size, args.split_capitals)
    args.out.mkdir(parents=True, exist_ok=True)
    save_hf_tokenizer(tok, args.out)
    held = [c.render() for c in conversations("heldout", 500)]
    n_tokens = sum(len(tok.encode(t).ids) for t in held)
    print(f"vocab {tok.get_vocab_size()}: {n_tokens / sum(map(len, held)):.4f} tokens/char on held-out")


if __name__ == "__main__":
    main()
