"""Request classification (exploration / execution) and the segment detector on the token stream."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from engine.mode import EXECUTION, EXPLORATION, Mode

# Features that ask for structure: the request is execution whatever the policy says.
STRUCTURAL = frozenset({"json_schema", "json_object", "tools_required", "sql"})
_FENCE_OPEN = re.compile(rb"(?:^|\n)```(json|sql)[ \t]*\n$")
FENCE_CLOSE = b"\n```"


@dataclass(frozen=True)
class Decision:
    """One mode decision: the request's initial mode or a switch inside a sequence."""

    mode: Mode
    reason: str
    token_index: int | None = None  # index in the generated tokens (None: before the first token)
    segment: str | None = None  # tool_call | json_fence | sql_fence
    engine_applied: bool | None = None  # the engine's per-sequence mode hook ran (None: not attempted)

    def to_dict(self) -> dict:
        d = {"mode": self.mode, "reason": self.reason, "token_index": self.token_index}
        if self.segment is not None:
            d["segment"] = self.segment
        if self.engine_applied is not None:
            d["engine_applied"] = self.engine_applied
        return d


def request_features(*, response_format: str | None, tools: bool, tool_choice: str | None) -> set[str]:
    """The structural features of a request, in the policy's vocabulary (ExecutionTrigger)."""
    features: set[str] = set()
    if response_format in ("json_schema", "json_object", "sql"):
        features.add(response_format)
    if tools and tool_choice not in (None, "auto", "none"):  # "required" or a named function
        features.add("tools_required")
    if tools and tool_choice != "none":
        features.add("tools_any")
    return features


def classify(features: Iterable[str], execution_when: Iterable[str]) -> Decision:
    """Execution when the request asks for structure or the policy's `execution_when` matches."""
    features = set(features)
    structural = sorted(features & STRUCTURAL)
    if structural:
        return Decision(EXECUTION, "request:" + ",".join(structural))
    configured = set(execution_when)
    if "always" in configured:
        return Decision(EXECUTION, "policy:always")
    matched = sorted(features & configured)
    if matched:
        return Decision(EXECUTION, "policy:" + ",".join(matched))
    return Decision(EXPLORATION, "default")


@dataclass
class Segment:
    kind: str  # tool_call | json_fence | sql_fence
    start: int  # first generated-token index the segment's constraint covers
    end: int | None = None  # one past the last token (None while open)


@dataclass
class SegmentDetector:
    """Watches one sequence's sampled tokens; opens a segment on the tool-call start token or at the end
    of a ```json / ```sql fence line, and closes it on the tool-call end token or the closing fence.

    Deterministic in the token ids, so the logits processor (which applies the constraint) and the
    response writer (which shapes the output) each run their own copy and agree.
    """

    token_bytes: Sequence[bytes | None]
    tool_open_id: int | None
    tool_close_id: int | None
    segment_modes: Mapping[str, Mode]  # kind -> mode (the policy's `segments`) (the policy's `segments`)
    fences: frozenset[str] = frozenset({"json", "sql"})  # languages whose fences open segments
    segments: list[Segment] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    _line: bytes = b""  # free-text bytes since the last newline (fence detection)
    _body: bytes = b""  # bytes of the open fence segment
    _next: int = 0

    @property
    def open(self) -> Segment | None:
        return self.segments[-1] if self.segments and self.segments[-1].end is None else None

    @property
    def mode(self) -> Mode:
        return EXECUTION if self.open is not None else EXPLORATION

    def push_all(self, token_ids: Sequence[int]) -> list[Decision]:
        """Feed the tokens not seen yet (callers pass the whole generated list); returns new decisions."""
        out = []
        for i in range(self._next, len(token_ids)):
            d = self.push(int(token_ids[i]))
            if d is not None:
                out.append(d)
        return out

    def push(self, token: int) -> Decision | None:
        index = self._next
        self._next += 1
        piece = self.token_bytes[token] if 0 <= token < len(self.token_bytes) else None
        seg = self.open
        if seg is not None:
            if seg.kind == "tool_call":
                if token == self.tool_close_id:
                    return self._close(seg, index, "tool_call_end")
                return None
            self._body += piece or b""
            if self._body.endswith(FENCE_CLOSE):
                return self._close(seg, index, "fence_close")
            return None
        if token == self.tool_open_id and self.segment_modes.get("tool_call") == EXECUTION:
            return self._open("tool_call", index, index, "tool_call_start")
        if piece:
            buf = self._line + piece
            m = _FENCE_OPEN.search(buf)
            cut = buf.rfind(b"\n", 0, len(buf) - 1)  # keep the current line (with its leading newline)
            self._line = buf[cut:] if cut >= 0 else buf
            if len(self._line) > 64:
                self._line = b"~"  # deep inside a long line: no fence can open before the next newline
            if m:
                lang = m.group(1).decode()
                kind = f"{lang}_fence"
                self._line = b""
                if lang in self.fences and self.segment_modes.get(kind) == EXECUTION:
                    self._body = b""
                    return self._open(kind, index + 1, index, f"fence_open:{lang}")
        return None

    def _open(self, kind: str, start: int, index: int, reason: str) -> Decision:
        self.segments.append(Segment(kind, start))
        d = Decision(EXECUTION, reason, index, kind)
        self.decisions.append(d)
        return d

    def _close(self, seg: Segment, index: int, reason: str) -> Decision:
        seg.end = index + 1
        self._line = b""
        d = Decision(EXPLORATION, reason, index, seg.kind)
        self.decisions.append(d)
        return d
