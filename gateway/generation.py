"""Drives the engine for one sequence: constraints, segment switches, validation, bounded strict retry."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import torch

from engine.async_engine import AsyncLLM
from engine.sampling_params import SamplingParams
from gateway.classify import EXECUTION, Decision, SegmentDetector
from gateway.plan import Plan
from gateway.structured.batch import default_masker
from gateway.structured.build import build_constraint
from gateway.structured.constraint import Constraint
from gateway.structured.errors import SQLPolicyViolation, StructuredOutputError, StructuredValidationError
from gateway.structured.segment import segment_body, segment_spec
from gateway.structured.sql_schema import DatabaseSchema, SQLPolicy
from gateway.structured.tools import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, text_before_tool_calls, tool_call_spec
from gateway.structured.validate import validate_json, validate_sql, validate_tool_calls
from gateway.structured.vocab import TokenizerInfo
from policies.resolve import PolicyDenied

log = logging.getLogger(__name__)
VALIDATION_ERRORS = (StructuredValidationError, SQLPolicyViolation)
RETRY_TEMPERATURE, RETRY_SEED = 0.7, 7919  # a strict retry after a greedy attempt that failed validation


@dataclass
class TextDelta:
    text: str


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
    validations: list[dict] = field(default_factory=list)
    cache_hits: dict[str, int] = field(default_factory=dict)  # prefix-cache blocks served per tier
    enforcement: dict | None = None  # JSON Schema: how each keyword was enforced (json_enforce.Enforcement)


Event = TextDelta | ToolCall | Finished


class ProcessorError(StructuredOutputError):
    """The segment constraint failed inside the engine loop (a server-side fault, reported as a 500)."""

    http_status = 500
    code = "constraint_failure"


@dataclass
class SegmentFences:
    """What the constraint of each segment kind is built from (per request)."""

    tools: list[dict]
    sql: tuple[DatabaseSchema, SQLPolicy] | None = None


def segment_factory(tok: TokenizerInfo, eos_ids: Sequence[int], max_tokens: int,
                    fences: SegmentFences) -> Callable[[str, int], Constraint]:
    """`make(kind, start)`: the constraint of a segment opened at generated-token index `start`."""
    def make(kind: str, start: int) -> Constraint:
        remaining = max(1, max_tokens - start)
        if kind == "tool_call":  # one call per segment, starting with the <tool_call> token itself
            spec = tool_call_spec(fences.tools, tok, "required", parallel_tool_calls=False)
        elif kind == "json_fence":
            spec = segment_spec("json")
        else:
            db, pol = fences.sql
            spec = segment_spec("sql", db_schema=db, policy=pol)
        return build_constraint(spec, tok, eos_ids=eos_ids, max_tokens=remaining)
    return make


def make_detector(tok: TokenizerInfo, segment_modes: dict[str, str], fences: SegmentFences) -> SegmentDetector:
    """The detector of one exploration sequence: tool calls always constrained; ```sql only with a schema."""
    modes = {**segment_modes, "tool_call": EXECUTION}  # a tool call is always acted upon
    langs = {"json"} | ({"sql"} if fences.sql is not None else set())
    return SegmentDetector(tok.token_bytes, tok.added_ids.get(TOOL_CALL_OPEN), tok.added_ids.get(TOOL_CALL_CLOSE),
                           modes, frozenset(langs))


class SegmentProcessor:
    """Logits processor for an exploration sequence: runs a SegmentDetector on the sampled ids and masks
    with the open segment's constraint. Never raises into the engine loop (that would fail every request):
    an error ends this sequence (EOS only) and is reported through `error`."""

    def __init__(self, detector: SegmentDetector, make: Callable[[str, int], Constraint], eos_ids: Sequence[int],
                 banned: Callable[[int], list[int]], on_switch: Callable[[Decision], None]):
        self.detector, self.make, self.eos_ids = detector, make, list(eos_ids)
        self.banned, self.on_switch = banned, on_switch
        self.constraint: Constraint | None = None
        self.error: BaseException | None = None

    def __call__(self, ids: Sequence[int], row: torch.Tensor) -> torch.Tensor:  # row [V]
        try:
            for d in self.detector.push_all(ids):
                seg = self.detector.segments[-1]
                self.constraint = self.make(seg.kind, seg.start) if d.mode == EXECUTION else None
                self.on_switch(d)
            if self.constraint is not None:
                seg = self.detector.open
                return self.constraint(ids[seg.start:], row)
            banned = self.banned(len(ids))
            if banned:
                row[banned] = float("-inf")
            return row
        except Exception as e:  # noqa: BLE001 - reported to this request only
            self.error = self.error or e
            keep = row[self.eos_ids].clone()
            row.fill_(float("-inf"))
            row[self.eos_ids] = keep.clamp(min=0)
            return row


def bias_processor(bias: dict[int, float]) -> Callable:
    ids = torch.tensor(list(bias), dtype=torch.long)
    vals = torch.tensor(list(bias.values()), dtype=torch.float32)

    on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def apply(_ids: Sequence[int], row: torch.Tensor) -> torch.Tensor:  # row [V]
        if row.device not in on:
            on[row.device] = (ids.to(row.device), vals.to(row.device))
        i, v = on[row.device]
        row[i] += v.to(row.dtype)
        return row

    return apply


class Generator:
    """Owns the per-model pieces (tokenizer views, EOS, mode hook) and runs sequences on an AsyncLLM."""

    def __init__(self, llm: AsyncLLM, tok: TokenizerInfo, strict_retries: int = 1):
        self.llm, self.tok, self.strict_retries = llm, tok, strict_retries
        self.tokenizer = llm.tokenizer
        self.eos_ids = sorted(llm.engine.eos_token_ids)
        self.tool_open = tok.added_ids.get(TOOL_CALL_OPEN)
        self.tool_close = tok.added_ids.get(TOOL_CALL_CLOSE)
        self.mode_hook = getattr(llm, "set_mode", None)

    def set_mode(self, request_id: str, mode: str) -> bool:
        """The engine's per-sequence mode switch (deferral off in execution) when it has one."""
        if self.mode_hook is None:
            return False
        try:
            self.mode_hook(request_id, mode)
            return True
        except Exception:  # noqa: BLE001 - a missing hook must not fail the request
            log.exception("engine set_mode failed for %s", request_id)
            return False

    def _params(self, plan: Plan, processors: list, strict: bool, index: int, attempt: int = 0) -> SamplingParams:
        seed = None if plan.seed is None else plan.seed + index
        temperature = 0.0 if strict else plan.temperature
        if strict and plan.temperature == 0.0 and attempt:
            # the failed attempt was greedy: a greedy rerun would repeat it byte for byte (execution is
            # batch-invariant), so the retry samples, seeded by the attempt so it is reproducible
            temperature, seed = RETRY_TEMPERATURE, (plan.seed or 0) + index + RETRY_SEED * attempt
        return SamplingParams(max_tokens=plan.max_tokens, temperature=temperature,
                              top_p=plan.top_p, top_k=plan.top_k, seed=seed,
                              logits_processors=([bias_processor(plan.logit_bias)] if plan.logit_bias else [])
                              + processors)

    def _stream(self, rid: str, plan: Plan, params: SamplingParams, mode: str):
        return self.llm.generate(rid, plan.prompt_ids, params, mode, cache_salt=plan.cache_salt)

    async def _collect(self, rid: str, plan: Plan, params: SamplingParams) -> tuple[list[int], str, dict]:
        ids: list[int] = []
        reason, hits = "stop", {}
        async for out in self._stream(rid, plan, params, EXECUTION):
            ids = out.token_ids
            hits = getattr(out, "cache_hits", None) or hits
            if out.finished:
                reason = out.finish_reason or "stop"
        return ids, reason, hits

    def _text(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode([t for t in ids if t not in self.eos_ids])

    # -- whole-request execution --------------------------------------------------------------
    async def run_structured(self, plan: Plan, rid: str, index: int = 0) -> AsyncIterator[Event]:
        """Constrain the whole output; validate; on failure regenerate greedily (bounded); yield the result."""
        decisions = [Decision(plan.decision.mode, plan.decision.reason, None, None, self.mode_hook is not None)]
        validations: list[dict] = []
        last: Exception | None = None
        for attempt in range(1 + self.strict_retries):
            constraint = await asyncio.to_thread(build_constraint, plan.spec, self.tok, eos_ids=self.eos_ids,
                                                 max_tokens=plan.max_tokens, mask_batcher=default_masker())
            params = self._params(plan, [constraint], strict=attempt > 0, index=index, attempt=attempt)
            ids, reason, hits = await self._collect(f"{rid}-a{attempt}" if attempt else rid, plan, params)
            text = self._text(ids)
            try:
                value = plan.validate(text)
                validations.append({"kind": plan.kind, "ok": True, "attempt": attempt})
                break
            except VALIDATION_ERRORS as e:
                validations.append({"kind": plan.kind, "ok": False, "attempt": attempt, "error": str(e)[:300]})
                last = e
        else:
            last.validations = validations  # type: ignore[union-attr]  (recorded by the caller)
            raise last  # type: ignore[misc]
        if plan.kind == "tool_calls":
            self._check_policy_tools(plan, value)
            before = text_before_tool_calls(text)
            if before:
                yield TextDelta(before)
            for call in value:
                yield ToolCall(call["name"], call["arguments"])
            reason = "tool_calls" if value else reason
        elif plan.kind == "sql":
            yield TextDelta(value.sql)
            reason = "stop"
        else:
            yield TextDelta(text)
            reason = "stop"
        report = getattr(constraint.compiled, "enforcement", None)
        yield Finished(reason, len(ids), decisions, attempt, validations, hits,
                       report.to_dict() if report is not None else None)

    @staticmethod
    def _check_policy_tools(plan: Plan, calls: list[dict]) -> None:
        if plan.policy is not None:
            try:
                plan.policy.check_tools(c["name"] for c in calls)
            except PolicyDenied as e:
                raise StructuredValidationError("tool_call", str(e)) from None

    def _min_call_tokens(self, tools: list[dict]) -> int:
        """A budget under which a tool call cannot complete: twice the shortest call with empty arguments."""
        shortest = min(len(self.tokenizer.encode(f'{TOOL_CALL_OPEN}\n{{"name": "{t["function"]["name"]}", '
                                                 f'"arguments": {{}}}}\n{TOOL_CALL_CLOSE}')) for t in tools)
        return 2 * shortest

    # -- exploration with segments ------------------------------------------------------------
    async def run_free(self, plan: Plan, rid: str, index: int = 0, strict: bool = False,
                       fences: SegmentFences | None = None) -> AsyncIterator[Event]:
        """Exploration: free text streams; structured segments are constrained, validated, then released."""
        fences = fences or SegmentFences(plan.tools)
        tools_on = bool(fences.tools) and plan.tool_choice != "none"
        decisions = [Decision(plan.decision.mode, plan.decision.reason, None, None, self.mode_hook is not None)]
        consumer = make_detector(self.tok, plan.segment_modes, fences)
        state = {"calls": 0}

        min_call = self._min_call_tokens(fences.tools) if tools_on else 0

        def banned(n_generated: int) -> list[int]:
            out = [self.tool_close] if self.tool_close is not None else []
            left = plan.max_tokens - n_generated
            if self.tool_open is not None and (not tools_on or (not plan.parallel_tool_calls and state["calls"])
                                               or left < min_call):
                out.append(self.tool_open)  # no tools, no more calls allowed, or no budget left for one
            return out

        def on_switch(d: Decision) -> None:
            self.set_mode(rid, d.mode)

        proc = SegmentProcessor(make_detector(self.tok, plan.segment_modes, fences), segment_factory(self.tok, self.eos_ids, plan.max_tokens, fences), self.eos_ids,
                                banned, on_switch)
        params = self._params(plan, [proc], strict, index)
        detok = self.tokenizer.stream()
        stops, hold = plan.stop, max((len(s) for s in plan.stop), default=1) - 1
        free, sent, seg_ids = "", 0, []
        n_tokens, reason, calls, validations = 0, "stop", 0, []
        gen = self._stream(rid, plan, params, plan.decision.mode)
        hits: dict = {}
        stopped = False
        try:
            async for out in gen:
                hits = getattr(out, "cache_hits", None) or hits
                for t in out.new_token_ids:
                    n_tokens += 1
                    if t in self.eos_ids:
                        continue
                    was_open = consumer.open
                    d = consumer.push(t)
                    if d is not None:
                        decisions.append(Decision(d.mode, d.reason, d.token_index, d.segment, self.mode_hook is not None))
                    if was_open is None and consumer.open is None:
                        free += detok.push(t)
                        continue
                    if was_open is None:  # a segment opened at this token
                        free += detok.flush()
                        cut = _find_stop(free, sent, stops)
                        if cut >= 0:  # the free text before the segment already ends the answer
                            break
                        if free[sent:]:
                            yield TextDelta(free[sent:])
                        sent = len(free)
                        seg_ids = [t] if consumer.open.kind == "tool_call" else []
                        continue
                    seg_ids.append(t)
                    if consumer.open is None:  # closed at this token
                        for ev in self._finish_segment(plan, fences, was_open.kind, seg_ids, validations):
                            if isinstance(ev, ToolCall):
                                calls += 1
                                state["calls"] = calls
                            yield ev
                cut = _find_stop(free, sent, stops)
                if cut >= 0:
                    if free[sent:cut]:
                        yield TextDelta(free[sent:cut])
                    sent, reason = cut, "stop"
                    stopped = True
                    break
                release = len(free) - _holdback(free, stops, hold)
                if release > sent:
                    yield TextDelta(free[sent:release])
                    sent = release
                if out.finished:
                    reason = out.finish_reason or "stop"
            else:
                free += detok.flush()
                if free[sent:]:
                    yield TextDelta(free[sent:])
        finally:
            await gen.aclose()
        if proc.error is not None:
            raise ProcessorError(f"constraint failed: {proc.error}")
        if consumer.open is not None and not stopped:
            validations.append({"kind": consumer.open.kind, "ok": False, "error": f"segment not closed ({reason})"})
            err = StructuredValidationError(consumer.open.kind, f"the segment was not closed when generation "
                                            f"ended ({reason}); raise max_tokens")
            err.validations = validations
            raise err
        yield Finished("tool_calls" if calls else reason, n_tokens, decisions, 0, validations, hits)

    def _finish_segment(self, plan: Plan, fences: SegmentFences, kind: str, ids: list[int],
                        validations: list[dict]) -> list[Event]:
        text = self.tokenizer.decode(ids)
        try:
            if kind == "tool_call":
                calls = validate_tool_calls(text, fences.tools, "required", parallel_tool_calls=False)
                self._check_policy_tools(plan, calls)
                validations.append({"kind": kind, "ok": True})
                return [ToolCall(c["name"], c["arguments"]) for c in calls]
            body = segment_body(text)
            if kind == "json_fence":
                validate_json(body, {})
            else:
                validate_sql(body, *fences.sql)
            validations.append({"kind": kind, "ok": True})
            return [TextDelta(text)]
        except VALIDATION_ERRORS as e:
            validations.append({"kind": kind, "ok": False, "error": str(e)[:300]})
            e.validations = validations
            raise

    def run(self, plan: Plan, rid: str, index: int = 0, fences: SegmentFences | None = None,
            strict: bool = False) -> AsyncIterator[Event]:
        """The events of one sequence: whole-output constraint when the plan has one, else segments."""
        if plan.spec is not None:
            return self.run_structured(plan, rid, index)
        return self.run_free(plan, rid, index, strict, fences)


def _find_stop(text: str, sent: int, stops: list[str]) -> int:
    """Index of the first stop string in the text not yet released (-1: none)."""
    hits = [i for i in (text.find(s, max(0, sent - len(s) + 1)) for s in stops) if i >= 0]
    return min(hits, default=-1)


def _holdback(text: str, stops: list[str], hold: int) -> int:
    """Characters at the end of `text` that could still grow into a stop string."""
    for n in range(min(hold, len(text)), 0, -1):
        if any(s.startswith(text[-n:]) for s in stops):
            return n
    return 0


async def collect(events: AsyncIterator[Event]) -> tuple[str, list[ToolCall], Finished]:
    """Non-streaming: the whole content, the tool calls and the finish event."""
    parts: list[str] = []
    calls: list[ToolCall] = []
    fin: Finished | None = None
    async for ev in events:
        if isinstance(ev, TextDelta):
            parts.append(ev.text)
        elif isinstance(ev, ToolCall):
            calls.append(ev)
        else:
            fin = ev
    assert fin is not None
    return "".join(parts), calls, fin


async def generate_complete(gen: Generator, plan: Plan, rid: str, index: int,
                            fences: SegmentFences | None) -> tuple[str, list[ToolCall], Finished]:
    """Non-streaming with the bounded strict retry also for segments in free text."""
    if plan.spec is not None:
        return await collect(gen.run(plan, rid, index, fences))
    last: Exception | None = None
    seen: list[dict] = []
    for attempt in range(1 + gen.strict_retries):
        try:
            rid_a = f"{rid}-a{attempt}" if attempt else rid
            text, calls, fin = await collect(gen.run(plan, rid_a, index, fences, strict=attempt > 0))
            fin.retries = attempt
            return text, calls, fin
        except VALIDATION_ERRORS as e:
            last = e
            seen.extend(getattr(e, "validations", []))
    last.validations = seen  # type: ignore[union-attr]
    raise last  # type: ignore[misc]
