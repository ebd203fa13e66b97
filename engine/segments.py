"""Structured segments inside one sequence's output: detected on the sampled tokens, switched at the token.

A segment opens on the tool-call start token or at the end of a ```json / ```sql fence line and closes on
the tool-call end token or the closing fence. The engine runs one `SegmentTracker` per sequence whose
SamplingParams carry `SegmentRules`: in the step that samples the token opening a segment it switches the
sequence to the segment's mode (so the segment's first token is already computed in that mode) and masks
with the segment's constraint from the next token on; at the closing token it switches back. The request's
outputs carry the text around segments and a `SegmentStart` / `SegmentEnd` per switch.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from engine.mode import Mode

_FENCE_OPEN = re.compile(rb"(?:^|\n)```(json|sql)[ \t]*\n$")
FENCE_CLOSE = b"\n```"

# A segment's constraint: (generated ids since the segment's first token, logits row [V]) -> masked row.
SegmentConstraint = Callable[[Sequence[int], torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Switch:
    """A mode switch inside a sequence, at generated-token index `token_index` (the token that opened or
    closed the segment)."""

    mode: Mode
    reason: str  # tool_call_start | fence_open:<lang> | tool_call_end | fence_close
    token_index: int
    segment: str  # tool_call | json_fence | sql_fence


@dataclass
class Segment:
    kind: str  # tool_call | json_fence | sql_fence
    start: int  # first generated-token index the segment's constraint covers
    end: int | None = None  # one past the last token (None while open)


@dataclass
class SegmentDetector:
    """Watches one sequence's sampled tokens and returns a Switch where a segment opens or closes.
    Deterministic in the token ids."""

    token_bytes: Sequence[bytes | None]
    tool_open_id: int | None
    tool_close_id: int | None
    segment_modes: Mapping[str, Mode]  # kind -> mode (the policy's `segments`); only execution opens one
    fences: frozenset[str] = frozenset({"json", "sql"})  # languages whose fences open segments
    segments: list[Segment] = field(default_factory=list)
    _line: bytes = b""  # free-text bytes since the last newline (fence detection)
    _body: bytes = b""  # bytes of the open fence segment
    _next: int = 0

    @property
    def open(self) -> Segment | None:
        return self.segments[-1] if self.segments and self.segments[-1].end is None else None

    @property
    def mode(self) -> Mode:
        return Mode.EXECUTION if self.open is not None else Mode.EXPLORATION

    def push_all(self, token_ids: Sequence[int]) -> list[Switch]:
        """Feed the tokens not seen yet (callers pass the whole generated list); returns new switches."""
        out = []
        for i in range(self._next, len(token_ids)):
            s = self.push(int(token_ids[i]))
            if s is not None:
                out.append(s)
        return out

    def push(self, token: int) -> Switch | None:
        index = self._next
        self._next += 1
        piece = self.token_bytes[token] if 0 <= token < len(self.token_bytes) else None
        seg = self.open
        if seg is not None:
            if seg.kind == "tool_call":
                return self._close(seg, index, "tool_call_end") if token == self.tool_close_id else None
            self._body += piece or b""
            return self._close(seg, index, "fence_close") if self._body.endswith(FENCE_CLOSE) else None
        if token == self.tool_open_id and self.segment_modes.get("tool_call") == Mode.EXECUTION:
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
                if lang in self.fences and self.segment_modes.get(kind) == Mode.EXECUTION:
                    self._body = b""
                    return self._open(kind, index + 1, index, f"fence_open:{lang}")
        return None

    def closes(self, token: int) -> bool:
        """Whether `token` would close the open segment (without pushing it)."""
        seg = self.open
        if seg is None or seg.kind == "tool_call":
            return seg is not None and token == self.tool_close_id
        piece = self.token_bytes[token] if 0 <= token < len(self.token_bytes) else None
        return (self._body + (piece or b"")).endswith(FENCE_CLOSE)

    def _open(self, kind: str, start: int, index: int, reason: str) -> Switch:
        self.segments.append(Segment(kind, start))
        return Switch(Mode.EXECUTION, reason, index, kind)

    def _close(self, seg: Segment, index: int, reason: str) -> Switch:
        seg.end = index + 1
        self._line = b""
        return Switch(Mode.EXPLORATION, reason, index, seg.kind)


@dataclass(frozen=True)
class SegmentRules:
    """What opens a segment in a sequence's output and what applies inside it (SamplingParams.segments)."""

    token_bytes: Sequence[bytes | None]
    tool_open_id: int | None
    tool_close_id: int | None
    modes: Mapping[str, Mode]  # kind -> mode
    fences: frozenset[str] = frozenset({"json", "sql"})
    constraint: Callable[[str, int], SegmentConstraint] | None = None  # (kind, start index) -> the constraint
    banned: Callable[[int, int], list[int]] | None = None  # (tokens generated, tool calls closed) -> free-text bans
    eos_ids: tuple[int, ...] = ()  # what a sequence may still sample once its constraint failed

    def detector(self) -> SegmentDetector:
        return SegmentDetector(self.token_bytes, self.tool_open_id, self.tool_close_id, self.modes, self.fences)


@dataclass(frozen=True)
class SegmentStart:
    switch: Switch
    applied: bool  # the engine switched the sequence's mode at this token


@dataclass(frozen=True)
class SegmentEnd:
    switch: Switch
    applied: bool
    token_ids: list[int]  # the segment's tokens (a tool call's include its start and end tokens)
    text: str


class SegmentTracker:
    """One sequence's segments: the detector, the open segment's constraint (a logits processor the engine
    appends to the sequence's own) and the events its next output reports. A constraint that fails never
    raises into the engine loop (that would fail every request): the sequence may then only end (EOS) and
    `error` says why."""

    def __init__(self, rules: SegmentRules):
        self.rules = rules
        self.detector = rules.detector()
        self.constraint: SegmentConstraint | None = None
        self.error: str | None = None
        self.tool_calls = 0  # tool-call segments closed so far
        self.events: list[SegmentStart | SegmentEnd] = []

    @property
    def open(self) -> Segment | None:
        return self.detector.open

    def push(self, token: int) -> Switch | None:
        """The sequence sampled `token`: the switch it causes, if any (the open segment's constraint is
        built here, so it masks the very next token)."""
        switch = self.detector.push(token)
        if switch is None:
            return None
        self.constraint = None
        if switch.mode == Mode.EXECUTION and self.rules.constraint is not None:
            seg = self.detector.open
            try:
                self.constraint = self.rules.constraint(seg.kind, seg.start)
            except Exception as e:  # noqa: BLE001 - reported to this request only
                self.error = self.error or f"{type(e).__name__}: {e}"
        elif switch.segment == "tool_call":
            self.tool_calls += 1
        return switch

    def forced_token(self, ids: Sequence[int]) -> int | None:
        """The one token the open segment's constraint allows next (engine/multi_token.py), or None: also for a
        token that would close the segment, whose KV is computed in the mode it switches to."""
        forced = getattr(self.constraint, "forced_token", None)
        if self.error is not None or forced is None:
            return None
        try:
            token = forced(ids[self.detector.open.start:])
        except Exception as e:  # noqa: BLE001 - reported to this request only
            self.error = self.error or f"{type(e).__name__}: {e}"
            return None
        return None if token is None or self.detector.closes(token) else token

    def __call__(self, ids: Sequence[int], row: torch.Tensor) -> torch.Tensor:  # row [V]
        try:
            if self.error is None and self.constraint is not None:
                return self.constraint(ids[self.detector.open.start:], row)
            if self.error is None:
                banned = self.rules.banned(len(ids), self.tool_calls) if self.rules.banned is not None else []
                if banned:
                    row[banned] = float("-inf")
                return row
        except Exception as e:  # noqa: BLE001 - reported to this request only
            self.error = self.error or f"{type(e).__name__}: {e}"
        eos = list(self.rules.eos_ids)
        keep = row[eos].clone()
        row.fill_(float("-inf"))
        row[eos] = keep.clamp(min=0)
        return row
