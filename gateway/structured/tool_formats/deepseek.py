"""DeepSeek tool calls: a block of calls between DeepSeek's own special tokens.

V3.1 (and V3.2's chat template):
    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
V3 / R1 / V2.5 (`fenced`): the type before the separator and the arguments in a ```json fence, calls on
separate lines:
    <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import ToolCallParseError
from .base import ToolFormat, delimited_calls, json_rule, lark_str, loads_args

CALLS_BEGIN, CALLS_END = "<\uff5ctool\u2581calls\u2581begin\uff5c>", "<\uff5ctool\u2581calls\u2581end\uff5c>"
CALL_BEGIN, CALL_END = "<\uff5ctool\u2581call\u2581begin\uff5c>", "<\uff5ctool\u2581call\u2581end\uff5c>"
SEP = "<\uff5ctool\u2581sep\uff5c>"
OUTPUTS_BEGIN, OUTPUTS_END = "<\uff5ctool\u2581outputs\u2581begin\uff5c>", "<\uff5ctool\u2581outputs\u2581end\uff5c>"
OUTPUT_BEGIN, OUTPUT_END = "<\uff5ctool\u2581output\u2581begin\uff5c>", "<\uff5ctool\u2581output\u2581end\uff5c>"
BOS, EOS = "<\uff5cbegin\u2581of\u2581sentence\uff5c>", "<\uff5cend\u2581of\u2581sentence\uff5c>"
USER, ASSISTANT = "<\uff5cUser\uff5c>", "<\uff5cAssistant\uff5c>"
TOKENS = (BOS, EOS, USER, ASSISTANT, CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP,
          OUTPUTS_BEGIN, OUTPUTS_END, OUTPUT_BEGIN, OUTPUT_END, "<think>", "</think>")
_FENCE = re.compile(r"(.*?)\n```json\n(.*)\n```\s*", re.DOTALL)


@dataclass(frozen=True)
class DeepSeekFormat(ToolFormat):
    fenced: bool = False  # the V3 / R1 form

    def call_rules(self, tools, tok, parallel):
        begin, end, cb, ce, sep = self.ids(tok, CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)
        between = ' "\\n"' if self.fenced else ""
        lines = [f"calls: <[{begin}]> call" + (f" ({between} call)*" if parallel else "") + f" <[{end}]>",
                 f"call: <[{cb}]> body <[{ce}]>",
                 "body: " + " | ".join(f"fn{i}" for i in range(len(tools)))]
        for i, tool in enumerate(tools):
            if self.fenced:
                lines.append(f'fn{i}: "function" <[{sep}]> {lark_str(tool.name + chr(10) + "```json" + chr(10))} '
                             f'{json_rule(tool.parameters)} "\\n```"')
            else:
                lines.append(f"fn{i}: {lark_str(tool.name)} <[{sep}]> {json_rule(tool.parameters)}")
        return lines

    def parse(self, text, tools):
        calls = []
        for head, body in delimited_calls(text, CALLS_BEGIN, CALLS_END, CALL_BEGIN, SEP, CALL_END):
            if self.fenced:
                m = _FENCE.fullmatch(body)
                if head.strip() != "function" or m is None:
                    raise ToolCallParseError(f"a call is not `function{SEP}NAME` and a ```json fence: {body[:200]!r}")
                name, raw = m.group(1).strip(), m.group(2)
            else:
                name, raw = head.strip(), body
            calls.append({"name": name, "arguments": loads_args(name, raw)})
        return calls

    def example_call(self, name):
        call = f"function{SEP}{name}\n```json\n{{}}\n```" if self.fenced else f"{name}{SEP}{{}}"
        return f"{CALLS_BEGIN}{CALL_BEGIN}{call}{CALL_END}{CALLS_END}"


DEEPSEEK_V31 = DeepSeekFormat("deepseek_v31", "chat_templates/deepseek_v31.jinja", TOKENS, (EOS,),
                              CALLS_BEGIN, CALLS_END, (SEP,), segment_holds_all=True,
                              arguments_as_text=True)
DEEPSEEK_V3 = DeepSeekFormat("deepseek_v3", "chat_templates/deepseek_v3.jinja", TOKENS, (EOS,),
                             CALLS_BEGIN, CALLS_END, (SEP,), segment_holds_all=True,
                             arguments_as_text=True, fenced=True)
