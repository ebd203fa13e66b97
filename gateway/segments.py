"""Structured segments of a free-text response, gateway side: what constrains each kind (built per request and
handed to the engine as SegmentRules) and what a closed segment becomes (validated tool calls or fenced text).
The engine detects the segments and switches modes at their tokens (engine/segments.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.mode import Mode
from engine.segments import SegmentEnd, SegmentRules
from gateway.events import TextDelta, ToolCall
from gateway.plan import Plan
from gateway.retry import VALIDATION_ERRORS, Validation, failed
from gateway.structured.build import build_constraint
from gateway.structured.constraint import Constraint
from gateway.structured.errors import StructuredOutputError, StructuredValidationError
from gateway.structured.segment import segment_body, segment_spec
from gateway.structured.sql_schema import DatabaseSchema, SQLPolicy
from gateway.structured.tool_formats import DEFAULT, ToolFormat
from gateway.structured.tools import tool_call_spec
from gateway.structured.validate import validate_json, validate_sql, validate_tool_calls
from gateway.structured.vocab import TokenizerInfo
from policies.resolve import PolicyDenied


class ProcessorError(StructuredOutputError):
    """The segment constraint failed inside the engine loop (a server-side fault, reported as a 500)."""

    http_status = 500
    code = "constraint_failure"


@dataclass
class SegmentFences:
    """What the constraint of each segment kind is built from (per request)."""

    tools: list[dict]
    sql: tuple[DatabaseSchema, SQLPolicy] | None = None


def _segment_parallel(plan: Plan) -> bool:
    """Whether one tool-call segment may hold several calls (formats whose block holds the turn's calls)."""
    return plan.tool_format.segment_holds_all and plan.parallel_tool_calls


def segment_factory(tok: TokenizerInfo, eos_ids: Sequence[int], max_tokens: int, fences: SegmentFences,
                    fmt: ToolFormat = DEFAULT, parallel: bool = False) -> Callable[[str, int], Constraint]:
    """`make(kind, start)`: the constraint of a segment opened at generated-token index `start` (`parallel`:
    a tool-call segment may hold several calls)."""
    def make(kind: str, start: int) -> Constraint:
        remaining = max(1, max_tokens - start)
        if kind == "tool_call":  # the call(s) of one segment, starting with its opening token itself
            spec = tool_call_spec(fences.tools, tok, "required", parallel, fmt)
        elif kind == "json_fence":
            spec = segment_spec("json")
        else:
            db, pol = fences.sql
            spec = segment_spec("sql", db_schema=db, policy=pol)
        return build_constraint(spec, tok, eos_ids=eos_ids, max_tokens=remaining)
    return make


def segment_rules(tok: TokenizerInfo, eos_ids: Sequence[int], plan: Plan, fences: SegmentFences,
                  min_call: int = 0) -> SegmentRules:
    """The segments of one free-text sequence: tool calls always constrained (execution), ```json fences per
    the policy, ```sql only with a schema; the tool-call start token banned where no call may start (no
    tools, one call already made without parallel calls, fewer than `min_call` tokens left); the end token
    banned in free text."""
    modes = {**plan.segment_modes, "tool_call": Mode.EXECUTION}  # a tool call is always acted upon
    langs = {"json"} | ({"sql"} if fences.sql is not None else set())
    fmt = plan.tool_format
    tool_open, tool_close = (tok.added_ids.get(t) if t else None for t in (fmt.segment_open, fmt.segment_close))
    tools_on = bool(fences.tools) and plan.tool_choice != "none"
    one_segment = fmt.segment_holds_all or not plan.parallel_tool_calls

    def banned(n_generated: int, calls: int) -> list[int]:
        out = [tool_close] if tool_close is not None else []
        if tool_open is not None and (not tools_on or (one_segment and calls)
                                      or plan.max_tokens - n_generated < min_call):
            out.append(tool_open)
        return out

    return SegmentRules(tok.token_bytes, tool_open, tool_close, modes, frozenset(langs),
                        constraint=segment_factory(tok, eos_ids, plan.max_tokens, fences, fmt, _segment_parallel(plan)),
                        banned=banned,
                        eos_ids=tuple(eos_ids))


def check_policy_tools(plan: Plan, calls: list[dict]) -> None:
    if plan.policy is not None:
        try:
            plan.policy.check_tools(c["name"] for c in calls)
        except PolicyDenied as e:
            raise StructuredValidationError("tool_call", str(e)) from None


def finish_segment(plan: Plan, fences: SegmentFences, end: SegmentEnd,
                   validations: list[Validation]) -> list[TextDelta | ToolCall]:
    """A closed segment, validated: its tool call, or its fenced text. A failure raises with the outcomes."""
    kind, text = end.switch.segment, end.text
    try:
        if kind == "tool_call":
            calls = validate_tool_calls(text, fences.tools, "required", _segment_parallel(plan), plan.tool_format)
            check_policy_tools(plan, calls)
            validations.append(Validation(kind, True))
            return [ToolCall(c["name"], c["arguments"]) for c in calls]
        body = segment_body(text)
        if kind == "json_fence":
            validate_json(body, {})
        else:
            validate_sql(body, *fences.sql)
        validations.append(Validation(kind, True))
        return [TextDelta(text)]
    except VALIDATION_ERRORS as e:
        validations.append(failed(kind, e))
        e.validations = tuple(validations)
        raise
