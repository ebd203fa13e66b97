"""The request loop of one choice: engine outputs in, gateway events out.

The engine makes the text (stop strings, hold-back), detects structured segments and switches modes at
their tokens; this module builds the SamplingParams, maps the engine's outputs to events (text deltas,
validated tool calls, the finish with its decisions and validations) and applies the retry policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Sequence

import torch

from engine.async_engine import AsyncLLM
from engine.mode import Mode
from engine.output import RequestOutput
from engine.sampling_params import SamplingParams
from engine.segments import SegmentEnd, SegmentRules
from gateway.classify import Decision
from gateway.events import Event, Finished, TextDelta, ToolCall
from gateway.plan import Plan
from gateway.retry import RETRY_TEMPERATURE, VALIDATION_ERRORS, RetryPolicy, Validation, failed
from gateway.segments import ProcessorError, SegmentFences, check_policy_tools, finish_segment, segment_rules
from gateway.structured.base import ConstraintSpec
from gateway.structured.batch import default_masker
from gateway.structured.build import build_constraint
from gateway.structured.cache import default_cache
from gateway.structured.constraint import Constraint
from gateway.structured.errors import StructuredValidationError
from gateway.structured.tool_formats import DEFAULT, ToolFormat
from gateway.structured.tool_formats.base import ChannelSplitter
from gateway.structured.tools import text_before_tool_calls
from gateway.structured.vocab import TokenizerInfo

__all__ = ["Generator", "Event", "Finished", "TextDelta", "ToolCall", "SegmentFences", "ProcessorError",
           "RETRY_TEMPERATURE", "collect", "generate_complete"]
RESYNC = "recompute"  # a segment's KV is recomputed in its mode: equal to an all-execution run from its prefix


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


async def bind_constraint(spec: ConstraintSpec, tok: TokenizerInfo, **kw) -> Constraint:
    """`build_constraint` for one sequence, from the event loop: a cached compile binds on the loop (~20 us, where a
    thread hop costs the loop GIL hand-offs with the engine thread, milliseconds at 8 streams); a compile
    (milliseconds to seconds) runs in a worker thread."""
    build = functools.partial(build_constraint, spec, tok, **kw)
    return build() if default_cache().compiled(spec, tok) is not None else await asyncio.to_thread(build)


class Generator:
    """Owns the per-model pieces (tokenizer views, EOS ids, retry policy) and runs choices on an AsyncLLM."""

    def __init__(self, llm: AsyncLLM, tok: TokenizerInfo, strict_retries: int = 1, tool_format: ToolFormat = DEFAULT):
        self.llm, self.tok, self.retry = llm, tok, RetryPolicy(strict_retries)
        self.tokenizer = llm.tokenizer
        self.eos_ids = sorted(llm.engine.eos_token_ids)
        self.tool_format = tool_format  # the family's tool-call format: its segment tokens open and close calls
        self.tool_open, self.tool_close = (tok.added_ids.get(t) if t else None
                                           for t in (tool_format.segment_open, tool_format.segment_close))

    @property
    def strict_retries(self) -> int:
        return self.retry.retries

    def _params(self, plan: Plan, processors: list, index: int, attempt: int,
                segments: SegmentRules | None = None) -> SamplingParams:
        temperature, seed = self.retry.sampling(plan.temperature, plan.seed, index, attempt)
        bias = [bias_processor(plan.logit_bias)] if plan.logit_bias else []
        return SamplingParams(max_tokens=plan.max_tokens, temperature=temperature, top_p=plan.top_p,
                              top_k=plan.top_k, seed=seed, stop=list(plan.stop),
                              logits_processors=bias + processors, segments=segments, resync=RESYNC)

    def _stream(self, rid: str, plan: Plan, params: SamplingParams, mode: Mode,
                final_only: bool = False) -> AsyncIterator[RequestOutput]:
        return self.llm.generate(rid, plan.prompt_ids, params, mode, cache_salt=plan.cache_salt, final_only=final_only)

    def _decision(self, plan: Plan) -> Decision:
        """The request's own mode: the engine ran the sequence in it from its first token."""
        return Decision(plan.decision.mode, plan.decision.reason, None, None, True)

    def run(self, plan: Plan, rid: str, index: int = 0, fences: SegmentFences | None = None,
            attempt: int = 0) -> AsyncIterator[Event]:
        """The events of one choice: a whole-output constraint when the plan has one, else free text with
        segments (`attempt` > 0: a strict retry)."""
        events = (self.run_structured(plan, rid, index) if plan.spec is not None
                  else self.run_free(plan, rid, index, attempt, fences))
        splitter = plan.tool_format.channels()
        return events if splitter is None else split_channels(events, splitter)

    # -- whole-request execution --------------------------------------------------------------
    async def run_structured(self, plan: Plan, rid: str, index: int = 0) -> AsyncIterator[Event]:
        """Constrain the whole output; validate; on failure regenerate (the retry policy); yield the result."""
        outcomes: list[Validation] = []

        async def attempt(i: int):
            constraint = await bind_constraint(plan.spec, self.tok, eos_ids=self.eos_ids, max_tokens=plan.max_tokens,
                                               mask_batcher=default_masker())
            params = self._params(plan, [constraint], index, i)
            # validated as a whole before anything leaves: only the finished output is delivered
            out = await self._last(self._stream(f"{rid}-a{i}" if i else rid, plan, params, Mode.EXECUTION,
                                                final_only=True))
            try:
                value = plan.validate(out.text)
            except VALIDATION_ERRORS as e:
                e.validations = (failed(plan.kind, e, attempt=i, output=out.text),)
                outcomes.append(e.validations[0])
                raise
            outcomes.append(Validation(plan.kind, True, attempt=i))
            return i, out, value, constraint

        i, out, value, constraint = await self.retry.run(attempt)
        reason = out.finish_reason or "stop"
        if plan.kind == "tool_calls":
            check_policy_tools(plan, value)
            # a family with channels: the whole turn, which split_channels splits (calls dropped)
            before = out.text if plan.tool_format.channels() is not None else \
                text_before_tool_calls(out.text, plan.tool_format)
            if before:
                yield TextDelta(before)
            for call in value:
                yield ToolCall(call["name"], call["arguments"])
            reason = "tool_calls" if value else reason
        else:
            yield TextDelta(value.sql if plan.kind == "sql" else out.text)
            reason = "stop"
        report = getattr(constraint.compiled, "enforcement", None)
        yield Finished(reason, len(out.token_ids), [self._decision(plan)], i, outcomes, out.cache_hits or {},
                       report.to_dict() if report is not None else None, out.num_cached_tokens)

    @staticmethod
    async def _last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
        last = None
        async with contextlib.aclosing(stream) as outs:
            async for out in outs:
                last = out
        return last

    def _min_call_tokens(self, tools: list[dict], fmt: ToolFormat) -> int:
        """A budget under which a tool call cannot complete: twice the shortest call with empty arguments."""
        return 2 * min(len(self.tokenizer.encode(fmt.example_call(t["function"]["name"]))) for t in tools)

    # -- free text with segments --------------------------------------------------------------
    async def run_free(self, plan: Plan, rid: str, index: int = 0, attempt: int = 0,
                       fences: SegmentFences | None = None) -> AsyncIterator[Event]:
        """Free text streams as the engine releases it; each segment is constrained and mode-switched by the
        engine, then validated here and released (a tool call, or the fenced text)."""
        fences = fences or SegmentFences(plan.tools)
        tools_on = bool(fences.tools) and plan.tool_choice != "none"
        rules = segment_rules(self.tok, self.eos_ids, plan, fences,
                              self._min_call_tokens(fences.tools, plan.tool_format) if tools_on else 0)
        params = self._params(plan, [], index, attempt, segments=rules)
        decisions, validations, calls = [self._decision(plan)], [], 0
        last: RequestOutput | None = None
        async with contextlib.aclosing(self._stream(rid, plan, params, plan.decision.mode)) as outs:
            async for last in outs:
                if last.new_text:
                    yield TextDelta(last.new_text)
                for ev in last.segment_events:
                    s = ev.switch
                    decisions.append(Decision(s.mode, s.reason, s.token_index, s.segment, ev.applied))
                    if isinstance(ev, SegmentEnd):
                        for item in finish_segment(plan, fences, ev, validations):
                            calls += isinstance(item, ToolCall)
                            yield item
        if last.segment_error is not None:
            raise ProcessorError(f"constraint failed: {last.segment_error}")
        reason = last.finish_reason or "stop"
        if last.open_segment is not None:
            validations.append(failed(last.open_segment, f"segment not closed ({reason})", output=last.text))
            err = StructuredValidationError(last.open_segment, f"the segment was not closed when generation "
                                            f"ended ({reason}); raise max_tokens")
            err.validations = tuple(validations)
            raise err
        yield Finished("tool_calls" if calls else reason, len(last.token_ids), decisions, attempt, validations,
                       last.cache_hits or {}, cached_tokens=last.num_cached_tokens)


async def split_channels(events: AsyncIterator[Event], splitter: ChannelSplitter) -> AsyncIterator[Event]:
    """A family with channels (harmony): each text delta split into reasoning and content deltas, the
    family's markers removed."""
    async with contextlib.aclosing(events) as evs:
        async for ev in evs:
            if isinstance(ev, TextDelta):
                pieces = splitter.feed(ev.text)
            elif isinstance(ev, Finished):
                pieces = splitter.close()
            else:
                pieces = []
            for kind, text in pieces:
                yield TextDelta(text, reasoning=kind == "reasoning")
            if not isinstance(ev, TextDelta):
                yield ev


async def collect(events: AsyncIterator[Event]) -> tuple[str, list[ToolCall], Finished]:
    """Non-streaming: the whole content, the tool calls and the finish event (with the reasoning text)."""
    parts: list[str] = []
    reasoning: list[str] = []
    calls: list[ToolCall] = []
    fin: Finished | None = None
    async for ev in events:
        if isinstance(ev, TextDelta):
            (reasoning if ev.reasoning else parts).append(ev.text)
        elif isinstance(ev, ToolCall):
            calls.append(ev)
        else:
            fin = ev
    assert fin is not None
    fin.reasoning = "".join(reasoning)
    return "".join(parts), calls, fin


async def generate_complete(gen: Generator, plan: Plan, rid: str, index: int,
                            fences: SegmentFences | None) -> tuple[str, list[ToolCall], Finished]:
    """Non-streaming: free text with segments is retried as a whole when a segment fails validation (a
    whole-output constraint retries inside `run_structured`)."""
    if plan.spec is not None:
        return await collect(gen.run(plan, rid, index, fences))
    return await gen.retry.run(lambda i: collect(gen.run(plan, f"{rid}-a{i}" if i else rid, index, fences, i)))

