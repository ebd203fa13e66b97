"""Qwen2.5/Qwen3 (Hermes) tool calls: a JSON object per call between <tool_call> tokens.

    <tool_call>\\n{"name": "<tool>", "arguments": {...}}\\n</tool_call>

Parallel calls are separated by a newline; tool results go back in <tool_response> blocks.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from ..errors import ToolCallParseError
from .base import ToolFormat, json_rule, loads_args

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)


@dataclass(frozen=True)
class QwenFormat(ToolFormat):
    def call_rules(self, tools, tok, parallel):
        open_id, close_id = self.ids(tok, OPEN, CLOSE)
        lines = ["calls: call" + (' ("\\n" call)*' if parallel else ""),
                 f'call: <[{open_id}]> "\\n" body "\\n" <[{close_id}]>',
                 "body: " + " | ".join(f"fn{i}" for i in range(len(tools)))]
        for i, tool in enumerate(tools):
            lines.append(f"fn{i}: " + json_rule({
                "type": "object", "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
                "required": ["name", "arguments"], "additionalProperties": False}))
        return lines

    def parse(self, text, tools):
        calls = []
        for m in _CALL.finditer(text):
            try:
                obj = json.loads(m.group(1))
            except json.JSONDecodeError as e:
                raise ToolCallParseError(f"tool call is not JSON ({e}): {m.group(1)[:200]!r}") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                raise ToolCallParseError(f"tool call needs a string 'name': {m.group(1)[:200]!r}")
            args = obj.get("arguments", {})
            if isinstance(args, str):  # arguments as JSON text, as OpenAI's own messages carry them
                args = loads_args(obj["name"], args)
            if not isinstance(args, dict):
                raise ToolCallParseError(f"arguments of {obj['name']!r} must be a JSON object")
            calls.append({"name": obj["name"], "arguments": args})
        if text.count(OPEN) != len(calls):
            raise ToolCallParseError(f"{text.count(OPEN)} {OPEN} tags but {len(calls)} complete calls")
        return calls

    def example_call(self, name):
        return f'{OPEN}\n{{"name": "{name}", "arguments": {{}}}}\n{CLOSE}'


QWEN = QwenFormat("qwen", "chat_templates/chatml_tools.jinja", (OPEN, CLOSE), ("<|im_end|>",), OPEN, CLOSE, (OPEN,))
