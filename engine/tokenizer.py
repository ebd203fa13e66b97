"""Tokenizer of a checkpoint directory: encode/decode, special ids, chat template, streaming detokenizer."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders

from engine.chat_template import ChatTemplateError, render_chat_template
from engine.detokenizer import ByteLevelStream, WindowedStream, bytes_to_unicode

# Named special tokens that transformers exposes to chat templates (its SPECIAL_TOKENS_ATTRIBUTES).
_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TokenizerLoadError(FileNotFoundError):
    """A checkpoint directory lacks a usable tokenizer."""


def _token_content(value: Any) -> str | None:
    """tokenizer_config values are a string, an AddedToken dict ({"content": ...}) or null."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise TokenizerLoadError(f"{path} is not valid JSON: {e}") from e


class Tokenizer:
    """A Hugging Face `tokenizers` tokenizer plus the checkpoint's tokenizer/generation config."""

    def __init__(
        self,
        tokenizer_json: bytes,
        tokenizer_config: Mapping[str, Any] | None = None,
        generation_config: Mapping[str, Any] | None = None,
        chat_template: str | dict[str, str] | None = None,
    ):
        self._json = tokenizer_json.decode("utf-8")
        self._tok = HFTokenizer.from_str(self._json)
        self.fingerprint = hashlib.sha256(tokenizer_json).hexdigest()
        self.config = dict(tokenizer_config or {})
        self.generation_config = dict(generation_config or {})
        template = chat_template if chat_template is not None else self.config.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
            template = {t["name"]: t["template"] for t in template}
        self.chat_template: str | dict[str, str] | None = template
        self.special_tokens_map = self._special_tokens_map()
        self._stream_table: list[bytes | None] | None = None
        self._stream_table_skip: list[bytes | None] | None = None

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json, generation_config.json and chat template files.

        chat_template.jinja and additional_chat_templates/*.jinja override tokenizer_config's
        chat_template, as in transformers."""
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise TokenizerLoadError(
                f"{tj} not found: moegate needs a fast-tokenizer tokenizer.json in the checkpoint directory "
                "(convert a slow tokenizer once with transformers' `AutoTokenizer.from_pretrained(...).save_pretrained(dir)`)"
            )
        template: str | dict[str, str] | None = None
        templates = {}
        if (path / "chat_template.jinja").is_file():
            templates["default"] = (path / "chat_template.jinja").read_text(encoding="utf-8")
        if (path / "additional_chat_templates").is_dir():  # transformers' CHAT_TEMPLATE_DIR
            for f in sorted((path / "additional_chat_templates").glob("*.jinja")):
                templates[f.stem] = f.read_text(encoding="utf-8")
        if len(templates) == 1 and "default" in templates:
            template = templates["default"]
        elif templates:
            template = templates
        return cls(
            tj.read_bytes(),
            _read_json(path / "tokenizer_config.json"),
            _read_json(path / "generation_config.json"),
            template,
        )

    def to_json(self) -> str:
        """The tokenizer.json text this tokenizer was built from."""
        return self._json

    # ---- vocabulary -------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (may be below the model's embedding rows)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def _special_tokens_map(self) -> dict[str, str]:
        named = {}
        for key, value in self.config.items():
            content = _token_content(value)
            if content is None:
                continue
            if key in _NAMED_SPECIAL_TOKENS or (key.endswith("_token") and (isinstance(value, str) or "__type" in value)):
                named[key] = content
        extra = self.config.get("extra_special_tokens")
        if isinstance(extra, Mapping):
            named.update({k: c for k, v in extra.items() if (c := _token_content(v)) is not None})
        return named

    def _named_id(self, name: str) -> int | None:
        content = self.special_tokens_map.get(name)
        return None if content is None else self.token_to_id(content)

    @property
    def eos_token_ids(self) -> list[int]:
        """tokenizer_config's eos_token, then generation_config's eos_token_id (int or list), deduplicated."""
        ids: list[int] = []
        if (eos := self._named_id("eos_token")) is not None:
            ids.append(eos)
        gen = self.generation_config.get("eos_token_id")
        for i in [gen] if isinstance(gen, int) else (gen or []):
            if i not in ids:
                ids.append(int(i))
        return ids

    @property
    def pad_token_id(self) -> int | None:
        pad = self._named_id("pad_token")
        return pad if pad is not None else self.generation_config.get("pad_token_id")

    @property
    def bos_token_id(self) -> int | None:
        bos = self._named_id("bos_token")
        return bos if bos is not None else self.generation_config.get("bos_token_id")

    @property
    def special_token_ids(self) -> set[int]:
        """Ids of added tokens flagged special (the ones `skip_special_tokens` drops)."""
        return {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    # ---- encode / decode --------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def stream(self, skip_special_tokens: bool = False) -> ByteLevelStream | WindowedStream:
        """A streaming detokenizer: `push(id) -> str` text delta (whole characters only), `flush() -> str`."""
        table = self._byte_table(skip_special_tokens)
        if table is not None:
            return ByteLevelStream(table)
        return WindowedStream(lambda ids: self.decode(ids, skip_special_tokens=skip_special_tokens))

    def _byte_table(self, skip_special_tokens: bool) -> list[bytes | None] | None:
        """Bytes of every id when the decoder is plain byte-level (tokenizers' ByteLevel decode rule)."""
        if not isinstance(self._tok.decoder, decoders.ByteLevel):
            return None
        if self._stream_table is None:
            u2b = {c: b for b, c in bytes_to_unicode().items()}
            table: list[bytes | None] = []
            for i in range(self.vocab_size):
                tok = self.id_to_token(i)
                if tok is None:
                    table.append(b"")
                elif all(c in u2b for c in tok):
                    table.append(bytes(u2b[c] for c in tok))
                else:  # tokenizers falls back to the token's own UTF-8 when a char is not byte-mapped
                    table.append(tok.encode("utf-8"))
            special = self.special_token_ids
            self._stream_table = table
            self._stream_table_skip = [None if i in special else b for i, b in enumerate(table)]
        return self._stream_table_skip if skip_special_tokens else self._stream_table

    # ---- chat -------------------------------------------------------------------------------------
    def get_chat_template(self, chat_template: str | None = None, tools: list | None = None) -> str:
        """The template transformers would pick: a named one, 'tool_use' when tools are given, or the default."""
        if isinstance(self.chat_template, dict):
            if chat_template is not None and chat_template in self.chat_template:
                return self.chat_template[chat_template]
            if chat_template is not None:
                return chat_template
            if tools is not None and "tool_use" in self.chat_template:
                return self.chat_template["tool_use"]
            if "default" in self.chat_template:
                return self.chat_template["default"]
            raise ChatTemplateError(f"several chat templates and no default: {sorted(self.chat_template)}")
        if chat_template is not None:
            return chat_template
        if self.chat_template is None:
            raise ChatTemplateError("this checkpoint has no chat_template (tokenizer_config.json or chat_template.jinja)")
        return self.chat_template

    def apply_chat_template(
        self,
        messages: list[Mapping[str, Any]],
        tools: list[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        documents: list[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """Render like `transformers` `apply_chat_template(..., tokenize=False)`; `extra` reaches the template."""
        return render_chat_template(
            self.get_chat_template(chat_template, tools),
            messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens_map,
            **extra,
        )

    def encode_chat(self, messages: list[Mapping[str, Any]], tools: list[Mapping[str, Any]] | None = None,
                    add_generation_prompt: bool = True, **extra: Any) -> list[int]:
        """Token ids of the rendered conversation (control tokens in the text become their ids)."""
        return self.encode(self.apply_chat_template(messages, tools, add_generation_prompt, **extra))
