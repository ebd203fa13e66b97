"""Request classification (exploration / execution) and the mode decisions a response reports."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from engine.mode import EXECUTION, EXPLORATION, Mode

# Features that ask for structure: the request is execution whatever the policy says.
STRUCTURAL = frozenset({"json_schema", "json_object", "tools_required", "sql"})


@dataclass(frozen=True)
class Decision:
    """One mode decision: the request's initial mode or a switch inside a sequence."""

    mode: Mode
    reason: str
    token_index: int | None = None  # index in the generated tokens (None: before the first token)
    segment: str | None = None  # tool_call | json_fence | sql_fence
    engine_applied: bool | None = None  # the engine switched the sequence's mode here (None: not reported)

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
