"""Kimi-K2 tool calls: a section of calls, each named `functions.NAME:IDX` (IDX counts the calls of the
conversation), its arguments JSON after its own token.

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{...}<|tool_call_end|>
    ...<|tool_calls_section_end|>
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import ToolCallParseError
from .base import ToolFormat, delimited_calls, json_rule, lark_str, loads_args

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGS_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
SYSTEM, USER, ASSISTANT, MIDDLE, IM_END = "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>"
TOKENS = (SYSTEM, USER, ASSISTANT, MIDDLE, IM_END, SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGS_BEGIN, CALL_END)
_ID = re.compile(r"\s*functions\.(.+):(\d+)\s*", re.DOTALL)


@dataclass(frozen=True)
class KimiFormat(ToolFormat):
    def call_rules(self, tools, tok, parallel):
        begin, end, cb, ab, ce = self.ids(tok, SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGS_BEGIN, CALL_END)
        lines = [f"calls: <[{begin}]> call" + (" call*" if parallel else "") + f" <[{end}]>",
                 f'call: <[{cb}]> "functions." body <[{ce}]>',
                 "body: " + " | ".join(f"fn{i}" for i in range(len(tools))),
                 "CALL_INDEX: /[0-9]{1,4}/"]
        for i, tool in enumerate(tools):
            lines.append(f"fn{i}: {lark_str(tool.name + ':')} CALL_INDEX <[{ab}]> {json_rule(tool.parameters)}")
        return lines

    def parse(self, text, tools):
        calls = []
        for head, raw in delimited_calls(text, SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGS_BEGIN, CALL_END):
            m = _ID.fullmatch(head)
            if m is None:
                raise ToolCallParseError(f"a call id is not `functions.NAME:INDEX`: {head[:200]!r}")
            calls.append({"name": m.group(1), "arguments": loads_args(m.group(1), raw)})
        return calls

    def example_call(self, name):
        return f"{SECTION_BEGIN}{CALL_BEGIN}functions.{name}:0{ARGS_BEGIN}{{}}{CALL_END}{SECTION_END}"


KIMI_K2 = KimiFormat("kimi_k2", "chat_templates/kimi_k2.jinja", TOKENS, (IM_END,), SECTION_BEGIN, SECTION_END,
                     (ARGS_BEGIN,), segment_holds_all=True, arguments_as_text=True)
