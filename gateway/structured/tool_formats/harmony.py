"""GPT-OSS tool calls in OpenAI's harmony format: a message on the commentary channel addressed to the tool.

    <|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>

The turn may first think on the analysis channel (`<|channel|>analysis<|message|>...<|end|><|start|>assistant`);
text for the user goes on the final channel. <|call|> and <|return|> end the turn (they are EOS ids), so a
turn holds at most one call. A call has no single opening token (the channel token also opens analysis and
final messages), so a request with tools is constrained as a whole rather than by segments.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import ToolCallParseError
from .base import TEXT, ChannelSplitter, ToolFormat, json_rule, lark_str, loads_args

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
TOKENS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
# One message: its header (channel, recipient, content type) and its body up to the next message or the end.
_MESSAGE = re.compile(r"(?:<\|start\|>assistant)?(.*?)<\|message\|>(.*?)(?=<\|end\|>|<\|call\|>|<\|return\|>|"
                      r"<\|start\|>|\Z)(?:<\|end\|>|<\|call\|>|<\|return\|>)?", re.DOTALL)
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>(\w+)")
_MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)


class HarmonyChannels(ChannelSplitter):
    """Harmony text as it streams: message bodies by channel (analysis -> reasoning; final and commentary
    preambles -> content), calls (a message addressed `to=` a function) and headers dropped; text outside
    any message (a model that writes no header) is content."""

    def __init__(self) -> None:
        self.held = ""  # a possible start of a marker, waiting for the next feed
        self.header: str | None = None  # the header being read (None: inside a body)
        self.kind = "content"  # where body text goes: reasoning | content | drop

    def feed(self, text: str) -> list[tuple[str, str]]:
        s, out, i = self.held + text, [], 0
        self.held = ""
        while (j := s.find("<|", i)) >= 0:
            self._text(s[i:j], out)
            marker = next((m for m in _MARKERS if s.startswith(m, j)), None)
            if marker is None:
                if any(m.startswith(s[j:]) for m in _MARKERS):  # cut inside a marker: wait for the rest
                    self.held = s[j:]
                    return out
                self._text("<|", out)
                i = j + 2
                continue
            self._marker(marker)
            i = j + len(marker)
        if s.endswith("<"):  # perhaps a marker's first character
            s, self.held = s[:-1], "<"
        self._text(s[i:], out)
        return out

    def close(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        self._text(self.held, out)
        self.held = ""
        return out

    def _text(self, text: str, out: list[tuple[str, str]]) -> None:
        if not text:
            return
        if self.header is not None:
            self.header += text
        elif self.kind != "drop":
            if out and out[-1][0] == self.kind:
                out[-1] = (self.kind, out[-1][1] + text)
            else:
                out.append((self.kind, text))

    def _marker(self, marker: str) -> None:
        if marker == START:
            self.header = ""
        elif marker in (CHANNEL, CONSTRAIN):
            self.header = (self.header or "") + marker
        elif marker == MESSAGE:
            header, self.header = self.header or "", None
            channel = _CHANNEL.search(header)
            self.kind = ("drop" if "to=" in header else
                         "reasoning" if channel is not None and channel.group(1) == "analysis" else "content")
        else:  # <|end|>, <|return|>, <|call|>: the message is over
            self.header, self.kind = None, "content"


@dataclass(frozen=True)
class HarmonyFormat(ToolFormat):
    def start_rule(self, required):
        return "start: analysis? calls" if required else "start: analysis? (final | calls)"

    def call_rules(self, tools, tok, parallel):
        start, end, message, channel, constrain = self.ids(tok, START, END, MESSAGE, CHANNEL, CONSTRAIN)
        lines = [f'analysis: <[{channel}]> "analysis" <[{message}]> TEXT? <[{end}]> <[{start}]> "assistant"',
                 f'final: <[{channel}]> "final" <[{message}]> TEXT?',
                 f'calls: <[{channel}]> "commentary to=functions." body',
                 "body: " + " | ".join(f"fn{i}" for i in range(len(tools)))]
        for i, tool in enumerate(tools):
            lines.append(f'fn{i}: {lark_str(tool.name + " ")} <[{constrain}]> "json" <[{message}]> '
                         f"{json_rule(tool.parameters)}")
        return lines

    def channels(self):
        return HarmonyChannels()

    def json_envelope(self, tok):
        start, end, message, channel = self.ids(tok, START, END, MESSAGE, CHANNEL)
        return "\n".join(["start: analysis? final",
                          f'analysis: <[{channel}]> "analysis" <[{message}]> TEXT? <[{end}]> <[{start}]> "assistant"',
                          f'final: <[{channel}]> "final" <[{message}]> @json_schema', TEXT]) + "\n"

    def _messages(self, text: str) -> list[tuple[str, str]]:
        if MESSAGE not in text:
            return []
        out = [(m.group(1), m.group(2)) for m in _MESSAGE.finditer(text) if m.group(0)]
        if len(out) != text.count(MESSAGE):
            raise ToolCallParseError(f"{text.count(MESSAGE)} {MESSAGE} tokens but {len(out)} harmony messages")
        return out

    def parse(self, text, tools):
        calls = []
        for header, body in self._messages(text):
            if "to=" not in header:
                continue
            m = _RECIPIENT.search(header)
            if m is None:
                raise ToolCallParseError(f"a message is addressed to something other than a function: {header[:200]!r}")
            channel = _CHANNEL.search(header)
            if channel is None or channel.group(1) != "commentary":
                raise ToolCallParseError(f"a call to {m.group(1)!r} is not on the commentary channel: {header[:200]!r}")
            calls.append({"name": m.group(1), "arguments": loads_args(m.group(1), body)})
        return calls

    def text_before(self, text):
        """The final channel's text (the analysis channel is the model's reasoning, not content)."""
        finals = [body for header, body in self._messages(text) if _CHANNEL.search(header)
                  and _CHANNEL.search(header).group(1) == "final" and "to=" not in header]
        return "".join(finals).strip()

    def example_call(self, name):
        return f"{CHANNEL}commentary to=functions.{name} {CONSTRAIN}json{MESSAGE}{{}}{CALL}"


HARMONY = HarmonyFormat("harmony", "chat_templates/gpt_oss.jinja", TOKENS, (RETURN, CALL), None, None, (MESSAGE,))
