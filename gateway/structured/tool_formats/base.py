"""The interface of a tool-call format: how one model family writes tool calls, constrains and parses them.

A format names its family's special tokens (each a single token of the tokenizer), the chat template that
renders tools, calls and results into the prompt (engine/chat_templates/), the Lark rules (llguidance
dialect) that constrain a turn's calls, and the parser that turns decoded text back into calls.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING

from ..errors import ConstraintCompileError, ToolCallParseError
from ..json_enforce import with_guidance_options

if TYPE_CHECKING:
    from ..vocab import TokenizerInfo

TEXT = "TEXT: /(?s:.+)/"


def json_rule(schema: dict) -> str:
    """`%json {...}`: a JSON value under `schema`, with the project's guidance options."""
    return "%json " + json.dumps(with_guidance_options(schema))


def lark_str(s: str) -> str:
    """A Lark string literal."""
    return json.dumps(s, ensure_ascii=False)


def loads_args(name: str, raw: str) -> dict:
    """A call's arguments: a JSON object, else a ToolCallParseError naming the tool."""
    try:
        args = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ToolCallParseError(f"arguments of {name!r} are not JSON ({e}): {raw[:200]!r}") from None
    if not isinstance(args, dict):
        raise ToolCallParseError(f"arguments of {name!r} must be a JSON object, got {raw[:200]!r}")
    return args



def delimited_calls(text: str, block_begin: str, block_end: str, call_begin: str, sep: str,
                    call_end: str) -> list[tuple[str, str]]:
    """(head, body) of every call in `block_begin (call_begin head sep body call_end)+ block_end` blocks
    of decoded text; ToolCallParseError on an unclosed block or an unfinished call."""
    blocks = re.findall(re.escape(block_begin) + "(.*?)" + re.escape(block_end), text, re.DOTALL)
    if text.count(block_begin) != len(blocks):
        raise ToolCallParseError(f"a {block_begin} block is not closed by {block_end}")
    call = re.compile(re.escape(call_begin) + "(.*?)" + re.escape(sep) + "(.*?)" + re.escape(call_end), re.DOTALL)
    calls = []
    for block in blocks:
        found = call.findall(block)
        if block.count(call_begin) != len(found) or not found:
            raise ToolCallParseError(f"{block.count(call_begin)} {call_begin} tokens but {len(found)} complete calls")
        calls.extend(found)
    return calls

@dataclass(frozen=True)
class ToolSpec:
    name: str
    parameters: dict

    @classmethod
    def from_openai(cls, tool: dict) -> ToolSpec:
        """Accepts {"type": "function", "function": {...}} or a bare {"name", "parameters"}."""
        fn = tool.get("function", tool) if tool.get("type", "function") == "function" else None
        if not fn or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ConstraintCompileError("tool_calls", f"tool definition without a function name: {tool!r:.200}")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ConstraintCompileError("tool_calls", f"parameters of {fn['name']!r} must be a JSON Schema object")
        return cls(fn["name"], params)


class ChannelSplitter(ABC):
    """Splits a turn's text, fed as it streams, into (kind, text) pieces: kind "reasoning" or "content"."""

    @abstractmethod
    def feed(self, text: str) -> list[tuple[str, str]]:
        """The pieces `text` completes (a possible start of a marker is held back until the next feed)."""

    @abstractmethod
    def close(self) -> list[tuple[str, str]]:
        """The pieces still held back, at the end of the turn."""

    def split(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of a whole turn."""
        parts = {"reasoning": [], "content": []}
        for kind, piece in [*self.feed(text), *self.close()]:
            parts[kind].append(piece)
        return "".join(parts["reasoning"]), "".join(parts["content"])


@dataclass(frozen=True)
class ToolFormat(ABC):
    """One family's tool-call wire format. `segment_open`/`segment_close` are the tokens that open and close
    a tool-call segment inside free text (None: the format has no single opening token, so a request with
    tools is constrained as a whole); `segment_holds_all` says a segment holds every call of the turn."""

    name: str
    template: str | None  # the family's chat template, a path inside the engine package (None: ship none)
    tokens: tuple[str, ...]  # special tokens the format needs as single tokens
    eos: tuple[str, ...]  # tokens that end the family's assistant turn
    segment_open: str | None
    segment_close: str | None
    json_starts: tuple[str, ...]  # tokens right before a JSON part (the finite-number guard restarts there)
    segment_holds_all: bool = False
    arguments_as_text: bool = False  # the family's template writes a past call's arguments as given (JSON text)

    def chat_template(self) -> str | None:
        if self.template is None:
            return None
        return resources.files("engine").joinpath(*self.template.split("/")).read_text(encoding="utf-8")

    def missing_tokens(self, tok: TokenizerInfo) -> list[str]:
        return [t for t in self.tokens if t not in tok.added_ids]

    def ids(self, tok: TokenizerInfo, *tokens: str) -> list[int]:
        return [tok.token_id(t) for t in tokens]

    def channels(self) -> ChannelSplitter | None:
        """A streaming splitter of the turn's text into reasoning and content, for a family whose turn holds
        channels (harmony); None: the text is all content."""
        return None

    def content(self, text: str) -> str:
        """The turn's content (what a whole-output JSON constraint validates): the text without its reasoning."""
        splitter = self.channels()
        return text if splitter is None else splitter.split(text)[1]

    def json_envelope(self, tok: TokenizerInfo) -> str:
        """Lark rules around a whole-output JSON value, which `@json_schema` marks (harmony: the final channel,
        after an optional analysis message); "" when the JSON value is the whole turn."""
        return ""

    def start_rule(self, required: bool) -> str:
        """The turn: only calls (required / named), or text, calls, or text then calls (auto)."""
        return "start: calls" if required else "start: TEXT | TEXT? calls"

    @abstractmethod
    def call_rules(self, tools: list[ToolSpec], tok: TokenizerInfo, parallel: bool) -> list[str]:
        """Lark rules defining `calls` (one or, when `parallel`, several calls of `tools`)."""

    @abstractmethod
    def parse(self, text: str, tools: dict[str, ToolSpec]) -> list[dict]:
        """Every complete call in decoded text as {"name", "arguments"}; ToolCallParseError on a malformed
        or unfinished one."""

    def text_before(self, text: str) -> str:
        """The assistant's content in decoded text that holds calls (OpenAI `message.content`): by default
        the text before the first `segment_open`."""
        return text.split(self.segment_open, 1)[0].strip() if self.segment_open else text.strip()

    @abstractmethod
    def example_call(self, name: str) -> str:
        """The text of the shortest call of `name` (empty arguments): sizes the budget a call needs."""
