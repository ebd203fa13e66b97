"""GLM-4.5 tool calls: the name, then one key/value pair per argument, between <tool_call> tokens.

    <tool_call>NAME\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n</tool_call>

A string argument's value is its raw text; any other value is JSON. The grammar writes the declared
properties in schema order (required ones always, optional ones when chosen); a string property is free
text under its `enum` / `const` / `minLength` / `maxLength` (`pattern` and `format` are left to validation).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from ..errors import ToolCallParseError
from .base import ToolFormat, json_rule, lark_str

OPEN, CLOSE = "<tool_call>", "</tool_call>"
KEY, KEY_END, VALUE, VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
TOKENS = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", OPEN, CLOSE,
          KEY, KEY_END, VALUE, VALUE_END, "<tool_response>", "</tool_response>", "<think>", "</think>")
_CALL = re.compile(re.escape(OPEN) + "(.*?)" + re.escape(CLOSE), re.DOTALL)
_PAIR = re.compile(re.escape(KEY) + "(.*?)" + re.escape(KEY_END) + r"\s*" + re.escape(VALUE) + "(.*?)"
                   + re.escape(VALUE_END), re.DOTALL)


def _is_string(schema: object) -> bool:
    """A string-valued property (written raw): type string, or an untyped enum / const of strings."""
    if not isinstance(schema, dict):
        return False
    options = schema.get("enum") or ([schema["const"]] if "const" in schema else None)
    untyped_strings = "type" not in schema and bool(options) and all(isinstance(o, str) for o in options)
    return schema.get("type") == "string" or untyped_strings


def _value_rule(schema: dict) -> str:
    if _is_string(schema):
        options = schema.get("enum") or ([schema["const"]] if "const" in schema else None)
        if options and all(isinstance(o, str) for o in options):
            return "(" + " | ".join(lark_str(o) for o in options) + ")"
        low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
        if low or high is not None:  # counted in characters, as JSON Schema counts them
            return f"/(?s:.{{{low},{'' if high is None else int(high)}}})/"
        return "TEXT?"
    return json_rule(schema)


@dataclass(frozen=True)
class GlmFormat(ToolFormat):
    def call_rules(self, tools, tok, parallel):
        open_id, close_id, k, k_end, v, v_end = self.ids(tok, OPEN, CLOSE, KEY, KEY_END, VALUE, VALUE_END)
        lines = ["calls: call" + (' ("\\n" call)*' if parallel else ""),
                 f"call: <[{open_id}]> body <[{close_id}]>",
                 "body: " + " | ".join(f"fn{i}" for i in range(len(tools)))]
        for i, tool in enumerate(tools):
            props = tool.parameters.get("properties") or {}
            required = set(tool.parameters.get("required") or [])
            parts = []
            for j, (key, schema) in enumerate(props.items()):
                lines.append(f'arg{i}_{j}: <[{k}]> {lark_str(key)} <[{k_end}]> "\\n" <[{v}]> '
                             f'{_value_rule(schema if isinstance(schema, dict) else {})} <[{v_end}]> "\\n"')
                parts.append(f"arg{i}_{j}" + ("" if key in required else "?"))
            lines.append(f'fn{i}: {lark_str(tool.name + chr(10))} {" ".join(parts)}'.rstrip())
        return lines

    def parse(self, text, tools):
        calls = []
        for m in _CALL.finditer(text):
            head, _, _ = m.group(1).partition(KEY)
            name = head.strip()
            if not name:
                raise ToolCallParseError(f"a tool call has no function name: {m.group(1)[:200]!r}")
            props = tools[name].parameters.get("properties") or {} if name in tools else {}
            args = {}
            for key, raw in _PAIR.findall(m.group(1)):
                key = key.strip()
                if _is_string(props.get(key)):
                    args[key] = raw
                    continue
                try:
                    args[key] = json.loads(raw)
                except json.JSONDecodeError as e:
                    raise ToolCallParseError(f"argument {key!r} of {name!r} is not JSON ({e}): {raw[:200]!r}") from None
            if m.group(1).count(KEY) != len(args):
                raise ToolCallParseError(f"a call to {name!r} has a malformed or repeated <arg_key> pair")
            calls.append({"name": name, "arguments": args})
        if text.count(OPEN) != len(calls):
            raise ToolCallParseError(f"{text.count(OPEN)} {OPEN} tokens but {len(calls)} complete calls")
        return calls

    def example_call(self, name):
        return f"{OPEN}{name}\n{CLOSE}"


GLM45 = GlmFormat("glm45", "chat_templates/glm4_moe.jinja", TOKENS, ("<|user|>", "<|observation|>"), OPEN, CLOSE, ())
