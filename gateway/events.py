"""What the gateway makes of one choice's engine outputs: text deltas, validated tool calls, the finish."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.classify import Decision
from gateway.retry import Validation


@dataclass
class TextDelta:
    text: str
    reasoning: bool = False  # the model's reasoning (harmony's analysis channel), not content


@dataclass
class ToolCall:
    name: str
    arguments: dict


@dataclass
class Finished:
    reason: str  # stop | length | tool_calls
    completion_tokens: int
    decisions: list[Decision]
    retries: int = 0
    validations: list[Validation] = field(default_factory=list)
    cache_hits: dict[str, int] = field(default_factory=dict)  # prefix-cache blocks served per tier
    enforcement: dict | None = None  # JSON Schema: how each keyword was enforced (json_enforce.Enforcement)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    reasoning: str = ""  # a collected (non-streamed) choice's reasoning text


Event = TextDelta | ToolCall | Finished
