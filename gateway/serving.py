"""One request's lifecycle shared by the endpoints: policy, admission, span, generation, audit, response."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from engine.errors import EngineError, RequestError
from engine.mode import Mode
from gateway.audit import audit_data
from gateway.deps import AppState, check_model
from gateway.errors import APIError, bad_request
from gateway.events import Finished, TextDelta, ToolCall
from gateway.generation import generate_complete
from gateway.limits import LimitExceeded, admit, settle
from gateway.plan import Plan, policy_error
from gateway.request_audit import RequestAudit, request_audit
from gateway.segments import SegmentFences
from gateway.sse import Chunker, ClosingStream, Sent, sse
from gateway.stores import (
    IdempotencyKeyMismatch,
    IdemState,
    StoredResponse,
    StoreUnavailable,
    request_fingerprint,
)
from gateway.structured.errors import StructuredOutputError
from policies.model import Tenant
from policies.resolve import PolicyDenied, ResolvedPolicy

log = logging.getLogger(__name__)
DEFAULT_MAX_TOKENS = 512


@dataclass
class Job:
    """What an endpoint hands to `serve`: the plan plus how to shape each result."""

    route: str
    operation: str  # chat | text_completion
    model: str
    plan: Plan
    stream: bool
    include_usage: bool
    audit_input: str
    fences: SegmentFences | None = None
    shape: Callable[..., dict] | None = None  # (id, created, results) -> response body
    chunker: type[Chunker] | None = None  # streaming chunk builder (a Chunker subclass)
    extra: dict = field(default_factory=dict)  # more audit metadata (the OpenAI `user`)


def resolve_policy(state: AppState, tenant: Tenant, route: str, model: str) -> ResolvedPolicy:
    check_model(state, model)
    try:
        return state.policy.resolve(tenant, route, model)
    except PolicyDenied as e:
        raise policy_error(e) from None


def budget(state: AppState, rp: ResolvedPolicy, prompt_len: int, requested: int | None, param: str) -> int:
    """max_tokens for the engine: the request's, else the policy cap, else a default; within the context."""
    room = state.llm.engine.max_model_len - prompt_len
    if room < 1:
        raise APIError(400, f"This model's maximum context length is {state.llm.engine.max_model_len} tokens; "
                            f"the prompt has {prompt_len}.", param="messages", code="context_length_exceeded")
    if requested is not None and requested > room:
        raise APIError(400, f"{param}={requested} plus the prompt's {prompt_len} tokens exceeds the context "
                            f"length {state.llm.engine.max_model_len}.", param=param, code="context_length_exceeded")
    return min(requested or rp.limits.max_tokens or DEFAULT_MAX_TOKENS, room)


def _admission_error(e: Exception) -> APIError:
    if isinstance(e, LimitExceeded):
        if e.retry_after is None:
            return APIError(400, str(e), param="max_tokens", code=f"{e.limit}_exceeded")
        return APIError(429, str(e), code=f"{e.limit}_exceeded",
                        headers={"Retry-After": str(max(1, int(e.retry_after + 0.999)))})
    return APIError(503, f"limit store unavailable: {e}", code="store_unavailable")


def _error_of(e: BaseException) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, StructuredOutputError):
        return APIError(e.http_status, str(e), code=e.code)
    if isinstance(e, RequestError):
        return bad_request(str(e), code="invalid_request")
    if isinstance(e, TimeoutError):
        return APIError(504, "the request timed out; generation was aborted", code="timeout")
    if isinstance(e, EngineError):
        return APIError(500, f"engine error: {e}", code="engine_error")
    log.exception("generation failed", exc_info=e)
    return APIError(500, f"internal error: {type(e).__name__}", code="internal_error")


async def serve(state: AppState, request: Request, tenant: Tenant, rp: ResolvedPolicy, job: Job, rid: str):
    """`Idempotency-Key` (non-streaming): a repeat gets the first response back, a concurrent duplicate
    waits for it (409 after the policy's wait), a reuse with another body is a 422."""
    key = request.headers.get("idempotency-key")
    if not key:
        return await _serve(state, request, tenant, rp, job, rid)
    if job.stream:
        raise bad_request("Idempotency-Key is not supported with stream=true", "stream", "unsupported_parameter")
    store = state.store
    scoped = f"{tenant.id}:{key}"
    try:
        fingerprint = request_fingerprint("POST", job.route, json.loads(await request.body()))
        begin = await store.idempotency_begin(scoped, fingerprint, wait_s=rp.idempotency_wait_s)
    except IdempotencyKeyMismatch:
        raise APIError(422, f"Idempotency-Key {key!r} was used with a different request body",
                       code="idempotency_key_reused") from None
    except StoreUnavailable as e:
        raise _admission_error(e) from None
    if begin.state is IdemState.COMPLETED:
        stored = begin.response
        return Response(stored.body, status_code=stored.status,
                        headers={**dict(stored.headers), "Idempotent-Replayed": "true"})
    if begin.state is IdemState.IN_PROGRESS:
        raise APIError(409, f"a request with Idempotency-Key {key!r} is still in progress; retry later",
                       code="idempotency_in_progress", headers={"Retry-After": "1"})
    try:
        response = await _serve(state, request, tenant, rp, job, rid)
    except BaseException:
        await store.idempotency_abandon(scoped, begin.token)
        raise
    await store.idempotency_complete(scoped, begin.token, StoredResponse(
        response.status_code, bytes(response.body), (("content-type", "application/json"),)),
        ttl_s=rp.idempotency_ttl_s)
    return response


async def _serve(state: AppState, request: Request, tenant: Tenant, rp: ResolvedPolicy, job: Job, rid: str):
    """Admission, then a JSON response or an SSE stream; errors become OpenAI error bodies."""
    m, plan = state.metrics, job.plan
    if state.in_flight >= state.settings.max_queue:
        m.rejected.labels("queue_full").inc()
        raise APIError(429, f"the server is at capacity ({state.settings.max_queue} requests in flight); retry",
                       code="server_busy", headers={"Retry-After": "1"})
    try:
        adm = await admit(state.store, rp.limits, tenant.id, len(plan.prompt_ids), plan.max_tokens)
    except (LimitExceeded, StoreUnavailable) as e:
        m.rejected.labels(getattr(e, "limit", "store")).inc()
        raise _admission_error(e) from None
    state.in_flight += 1
    m.in_flight.inc()
    m.mode.labels(plan.decision.mode).inc()

    released = False

    async def done() -> None:  # once, whichever path ends the request first
        nonlocal released
        if released:
            return
        released = True
        state.in_flight -= 1
        m.in_flight.dec()
        await adm.release()

    def span():
        return state.telemetry.request_span(
            request.headers, model=job.model, operation=job.operation, tenant=tenant.id, policy_id=rp.policy_id,
            policy_digest=rp.policy_digest, mode=plan.decision.mode, numerics_fingerprint=state.fingerprints[plan.decision.mode],
            params=plan.sampling_fields())

    created, marker = int(time.time()), request_audit(request.scope)
    if job.stream:
        ctx, sent = _Ctx(state, None, tenant, rp, job, rid, created, marker), Sent()
        return ClosingStream(_stream(ctx, sent, span, done), lambda: _end_stream(ctx, sent, done),
                              media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Request-Id": rid})
    try:
        with span() as rt:
            ctx = _Ctx(state, rt, tenant, rp, job, rid, created, marker)
            _classified(rt, plan)
            try:
                results = await _run_until_disconnect(request, ctx)
                body = job.shape(rid, created, results, state.fingerprints[plan.decision.mode])
                await ctx.finish(results, body)
                return JSONResponse(body, headers=rt.inject({"X-Request-Id": rid}))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - one request's failure is its own
                err = _error_of(e)
                rt.error(err.code or type(e).__name__, err.message)
                ctx.record_failed_validations(e)
                await ctx.audit_failure(err, e)
                raise err from None
    finally:
        await done()


def _sent_output(sent: Sent) -> dict:
    """What a stream handed the client, as an audit record's output entry."""
    return _output("".join(sent.text), sent.calls, "".join(sent.reasoning))


def _output(text: str, calls: list[ToolCall], reasoning: str) -> dict:
    """One choice's output in an audit record: content, tool calls and, when there is some, the reasoning."""
    out = {"content": text, "tool_calls": [{"name": c.name, "arguments": c.arguments} for c in calls]}
    return {**out, "reasoning": reasoning} if reasoning else out


def _classified(rt, plan: Plan) -> None:
    with rt.phase("classification", **{"moegate.mode": plan.decision.mode, "moegate.reason": plan.decision.reason}):
        pass


@dataclass
class _Ctx:
    state: AppState
    rt: Any
    tenant: Tenant
    rp: ResolvedPolicy
    job: Job
    rid: str
    created: int
    marker: RequestAudit  # settled once this request's record is written (or its level writes none)

    async def finish(self, results: list[tuple[str, list[ToolCall], Finished]], body: dict | None) -> None:
        m, rt, plan = self.state.metrics, self.rt, self.job.plan
        out_tokens = sum(f.completion_tokens for _, _, f in results)
        reasons = [f.reason for _, _, f in results]
        m.tokens.labels("prompt").inc(len(plan.prompt_ids))
        m.tokens.labels("completion").inc(out_tokens)
        for _, _, fin in results:
            for d in fin.decisions[1:]:
                rt.mode_switch(Mode.EXPLORATION if d.mode == Mode.EXECUTION else Mode.EXECUTION, d.mode, d.reason,
                               d.token_index)
                m.switches.labels(d.mode, d.segment or "").inc()
            for v in fin.validations:
                rt.validation(v.kind, v.ok, [v.error] if v.error is not None else [], fin.retries)
                m.validations.labels(v.kind, "pass" if v.ok else "fail").inc()
            m.retries.inc(fin.retries)
        hits = {}
        for _, _, fin in results:
            for tier, n in fin.cache_hits.items():
                hits[tier] = hits.get(tier, 0) + n
        rt.cache_hits([t for t, n in hits.items() if n], sum(hits.values()) or None)
        rt.usage(len(plan.prompt_ids), out_tokens, reasons, self.rid, self.job.model)
        await settle(self.state.store, self.rp.limits, self.tenant.id, len(plan.prompt_ids) + out_tokens)
        output = json.dumps([_output(t, calls, fin.reasoning) for t, calls, fin in results], ensure_ascii=False)
        await self._audit({"status": 200, "finish_reasons": reasons, "usage": {
            "prompt_tokens": len(plan.prompt_ids), "completion_tokens": out_tokens},
            "decisions": [[d.to_dict() for d in f.decisions] for _, _, f in results],
            "validations": [[v.to_dict() for v in f.validations] for _, _, f in results],
            "retries": [f.retries for _, _, f in results]}, output)

    def record_failed_validations(self, e: BaseException) -> None:
        checks = e.validations if isinstance(e, StructuredOutputError) else ()
        retries = max(0, sum(1 for v in checks if not v.ok) - 1)
        for v in checks:
            self.rt.validation(v.kind, v.ok, [v.error] if v.error is not None else [], retries)
            self.state.metrics.validations.labels(v.kind, "pass" if v.ok else "fail").inc()
        self.state.metrics.retries.inc(retries)

    async def audit_failure(self, err: APIError, e: BaseException, sent: Sent | None = None) -> None:
        """A request that failed: the error, each validation, and every output the client did not get as an
        answer (the text a stream had sent, each rejected attempt's text), so nothing generated is lost."""
        checks = e.validations if isinstance(e, StructuredOutputError) else ()
        outputs = [{**_sent_output(sent), "sent": True}] if sent and sent.chunks else []
        outputs += [{"content": v.output, "attempt": v.attempt, "kind": v.kind, "rejected": v.error}
                    for v in checks if v.output is not None]
        meta = {"status": err.status, "error": err.code, "message": err.message[:300]}
        if checks:
            meta["validations"] = [v.to_dict() for v in checks]
        await self._audit(meta, json.dumps(outputs, ensure_ascii=False) if outputs else "")

    async def audit_cut(self, sent: Sent) -> None:
        """A stream the client closed before its end: what was sent, marked as cut."""
        output = json.dumps([_sent_output(sent)], ensure_ascii=False)
        await self._audit({"status": 499, "error": "client_disconnected", "cut": True, "chunks_sent": sent.chunks,
                           "finish_reasons": [sent.fin.reason] if sent.fin else None,
                           "message": "the client closed the stream; generation was aborted"}, output)

    async def _audit(self, meta: dict, output: str) -> None:
        plan = self.job.plan
        base = {"request_id": self.rid, "route": self.job.route, "tenant": self.tenant.id, "model": self.job.model,
                "policy_id": self.rp.policy_id, "policy_digest": self.rp.policy_digest,
                "mode": plan.decision.mode, "mode_reason": plan.decision.reason,
                "numerics_fingerprint": self.state.fingerprints[plan.decision.mode], "params": plan.sampling_fields(),
                **self.job.extra, **meta}
        data = audit_data(self.rp.audit_level, base, {"input": self.job.audit_input, "output": output},
                          self.rp.redact)
        if data is None:
            self.marker.settled = True
            return
        try:
            rec = await self.state.audit.aappend(f"{self.job.operation}.completion", data,
                                                 trace_id=self.rt.trace_id if self.rt else None)
        except Exception as e:  # noqa: BLE001 - logged; the middleware writes the request's record instead
            log.exception("audit append failed for %s", self.rid)
            self.marker.failure = f"{type(e).__name__}: {e}"
            return
        self.marker.settled = True
        if self.rt is not None:
            self.rt.audit_record(rec.seq, rec.hash)

    async def run_one(self, index: int) -> tuple[str, list[ToolCall], Finished]:
        gen = self.state.generator
        rid = f"{self.rid}-{index}"
        with self.rt.phase("decode", **{"moegate.choice": index}):
            return await generate_complete(gen, self.job.plan, rid, index, self.job.fences)


async def _run_until_disconnect(request: Request, ctx: _Ctx) -> list:
    """Run the n choices; a client disconnect cancels them (closing the engine streams aborts them). The
    disconnect is awaited (the server's http.disconnect), not polled: a poll costs each request a cancel scope
    (and a task repr) on the event loop every quarter second, beside the engine thread's steps."""
    timeout = ctx.state.settings.request_timeout_s
    task = asyncio.ensure_future(asyncio.wait_for(
        asyncio.gather(*(ctx.run_one(i) for i in range(ctx.job.plan.n))), timeout))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        ctx.state.metrics.aborts.labels("disconnect").inc()
        task.cancel()
        raise APIError(499, "the client closed the request; generation was aborted", code="client_disconnected")
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _disconnected(request: Request) -> None:
    """Returns when the client has closed the connection (the request body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _end_stream(ctx: _Ctx, sent: Sent, done: Callable) -> None:
    """Settle a stream once: a `cut` record when it ended without its own, then release admission."""
    with anyio.CancelScope(shield=True):
        try:
            if not ctx.marker.settled and ctx.marker.failure is None:
                ctx.state.metrics.aborts.labels("disconnect").inc()
                if ctx.rt is not None:
                    ctx.rt.error("client_disconnected", "the client closed the stream")
                await ctx.audit_cut(sent)
        finally:
            await done()


async def _stream(ctx: _Ctx, sent: Sent, span: Callable, done: Callable) -> AsyncIterator[bytes]:
    """The SSE chunks of one choice. Its record is written before [DONE] (a client that saw [DONE] finds it);
    a client that leaves earlier gets a `cut` record of what was sent."""
    job, gen = ctx.job, ctx.state.generator
    chunker = job.chunker(ctx.rid, ctx.created, job.model, ctx.state.fingerprints[job.plan.decision.mode])
    with span() as rt:
        ctx.rt = rt
        _classified(rt, job.plan)
        try:
            yield sse(chunker.start())
            sent.chunks += 1
            async with asyncio.timeout(ctx.state.settings.request_timeout_s), \
                    contextlib.aclosing(gen.run(job.plan, f"{ctx.rid}-0", 0, job.fences)) as events:
                async for ev in events:
                    if isinstance(ev, TextDelta):
                        rt.first_token()
                        yield chunker.reasoning_sse(ev.text) if ev.reasoning else chunker.text_sse(ev.text)
                        (sent.reasoning if ev.reasoning else sent.text).append(ev.text)
                        sent.chunks += 1
                    elif isinstance(ev, ToolCall):
                        rt.first_token()
                        for chunk in chunker.tool_call(len(sent.calls), ev):
                            yield sse(chunk)
                            sent.chunks += 1
                        sent.calls.append(ev)
                    else:
                        sent.fin = ev
            yield sse(chunker.finish(sent.fin))
            sent.chunks += 1
            if job.include_usage:
                yield sse(chunker.usage(len(job.plan.prompt_ids), sent.fin.completion_tokens, sent.fin.cached_tokens))
                sent.chunks += 1
            with anyio.CancelScope(shield=True):
                sent.fin.reasoning = "".join(sent.reasoning)
                await ctx.finish([("".join(sent.text), sent.calls, sent.fin)], None)
            yield sse("[DONE]")
        except Exception as e:  # noqa: BLE001 - reported in the stream, as OpenAI does
            err = _error_of(e)
            rt.error(err.code or type(e).__name__, err.message)
            ctx.record_failed_validations(e)
            with anyio.CancelScope(shield=True):
                await ctx.audit_failure(err, e, sent)
            yield sse(err.body())
        finally:
            await _end_stream(ctx, sent, done)
