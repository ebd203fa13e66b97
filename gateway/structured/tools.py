"""Tool calls in the Qwen2.5/Qwen3 chat-template syntax: constraint grammar and output parser.

    <tool_call>\\n{"name": "<tool>", "arguments": {...}}\\n</tool_call>

<tool_call> and </tool_call> are special tokens; parallel calls are separated by a newline.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from .base import ConstraintKind, ConstraintSpec
from .errors import ConstraintCompileError, ToolCallParseError
from .json_enforce import with_guidance_options
from .vocab import TokenizerInfo

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


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


def _choice(tool_choice: str | dict | None) -> tuple[str, str | None]:
    """Normalise OpenAI tool_choice to (mode, forced name)."""
    if tool_choice is None:
        return "auto", None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise ConstraintCompileError("tool_calls", f"tool_choice must be none, auto, required or a named function, got {tool_choice!r}")
        return tool_choice, None
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
    if not name:
        raise ConstraintCompileError("tool_calls", f"named tool_choice needs function.name: {tool_choice!r:.200}")
    return "named", name


def tool_call_grammar(
    tools: list[ToolSpec], tokenizer: TokenizerInfo, tool_choice: str | dict | None = "auto",
    parallel_tool_calls: bool = True,
) -> str:
    """A Lark grammar (llguidance dialect) for the assistant turn under `tool_choice`."""
    mode, forced = _choice(tool_choice)
    text = 'TEXT: /(?s:.+)/'
    if mode == "none":
        return f"start: TEXT?\n{text}\n"
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ConstraintCompileError("tool_calls", f"duplicate tool names in {names}")
    if forced is not None:
        if forced not in names:
            raise ConstraintCompileError("tool_calls", f"tool_choice names {forced!r}, which is not among the tools {names}")
        tools = [t for t in tools if t.name == forced]
    if not tools:
        raise ConstraintCompileError("tool_calls", f"tool_choice {mode!r} needs at least one tool")
    open_id, close_id = tokenizer.token_id(TOOL_CALL_OPEN), tokenizer.token_id(TOOL_CALL_CLOSE)
    lines = ["calls: call" + (' ("\\n" call)*' if parallel_tool_calls else ""),
             f'call: <[{open_id}]> "\\n" body "\\n" <[{close_id}]>',
             "body: " + " | ".join(f"fn{i}" for i in range(len(tools)))]
    for i, tool in enumerate(tools):
        schema = {
            "type": "object",
            "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        lines.append(f"fn{i}: %json " + json.dumps(with_guidance_options(schema)))
    start = "start: calls" if mode in ("required", "named") else "start: TEXT | TEXT? calls"
    return "\n".join([start, *lines, text]) + "\n"


def tool_call_spec(tools: list[dict], tokenizer: TokenizerInfo, tool_choice: str | dict | None = "auto",
                   parallel_tool_calls: bool = True) -> ConstraintSpec:
    specs = [ToolSpec.from_openai(t) for t in tools]
    return ConstraintSpec(ConstraintKind.TOOL_CALLS,
                          tool_call_grammar(specs, tokenizer, tool_choice, parallel_tool_calls))


def parse_tool_calls(text: str) -> list[dict]:
    """Parse every <tool_call> block of decoded text into {"name", "arguments"} dicts."""
    calls = []
    for m in _CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError as e:
            raise ToolCallParseError(f"tool call is not JSON ({e}): {m.group(1)[:200]!r}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise ToolCallParseError(f"tool call needs a string 'name': {m.group(1)[:200]!r}")
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError as e:
                raise ToolCallParseError(f"arguments of {obj['name']!r} are not JSON: {e}") from None
        if not isinstance(args, dict):
            raise ToolCallParseError(f"arguments of {obj['name']!r} must be a JSON object")
        calls.append({"name": obj["name"], "arguments": args})
    if text.count(TOOL_CALL_OPEN) != len(calls):
        raise ToolCallParseError(f"{text.count(TOOL_CALL_OPEN)} <tool_call> tags but {len(calls)} complete calls")
    return calls


def text_before_tool_calls(text: str) -> str:
    """The assistant content preceding the first tool call (OpenAI `message.content`)."""
    return text.split(TOOL_CALL_OPEN, 1)[0].strip()
