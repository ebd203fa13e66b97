"""POST /v1/chat/completions: chat template, plan, then a JSON response or an SSE stream."""

from __future__ import annotations

import json

from fastapi import APIRouter, Request

from engine.chat_template import ChatTemplateError
from gateway.deps import State, TenantDep
from gateway.errors import bad_request
from gateway.events import Finished, ToolCall
from gateway.plan import chat_plan, dumps_args, policy_error, sql_target
from gateway.schemas import (
    ChatCompletion,
    ChatCompletionRequest,
    ErrorBody,
    Message,
    lone_surrogate_at,
    new_id,
    random_hex,
)
from gateway.segments import SegmentFences
from gateway.serving import Job, budget, resolve_policy, serve
from gateway.sse import Chunker, usage_of
from gateway.structured.sql_schema import tables_prompt
from gateway.structured.tool_formats import DEFAULT, ToolFormat
from policies.resolve import PolicyDenied

ROUTE = "/v1/chat/completions"
router = APIRouter()
_ERRORS = {s: {"model": ErrorBody} for s in (400, 401, 403, 404, 413, 429, 500, 503, 504)}


def _template_messages(messages: list[Message], arguments_as_text: bool = False) -> list[dict]:
    """The messages as chat templates read them; a call's arguments an object, or its JSON text where the
    family's template writes them verbatim (`ToolFormat.arguments_as_text`); an earlier turn's reasoning."""
    out = []
    for i, m in enumerate(messages):
        d: dict = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.name:
            d["name"] = m.name
        if getattr(m, "tool_call_id", None):
            d["tool_call_id"] = m.tool_call_id
        if getattr(m, "reasoning_content", None):
            # under both names chat templates read it: `thinking` (GPT-OSS's), `reasoning_content` (Qwen3's)
            d["thinking"] = d["reasoning_content"] = m.reasoning_content
        if getattr(m, "tool_calls", None):
            calls = []
            for j, c in enumerate(m.tool_calls):
                param = f"messages.{i}.tool_calls.{j}.function.arguments"
                try:
                    args = json.loads(c.function.arguments)
                except json.JSONDecodeError:
                    raise bad_request(f"tool call {c.id} arguments are not JSON", param, "invalid_value") from None
                if lone_surrogate_at(args) is not None:
                    raise bad_request(f"tool call {c.id} arguments hold an unpaired UTF-16 surrogate (e.g. \\ud800), "
                                      "which is not Unicode text", param, "invalid_unicode")
                if arguments_as_text:
                    args = json.dumps(args, ensure_ascii=False)
                calls.append({"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": args}})
            d["tool_calls"] = calls
        out.append(d)
    return out


def _prompt_messages(body: ChatCompletionRequest, fmt: ToolFormat = DEFAULT) -> list[dict]:
    """The conversation the model reads: the client's messages, and for a SQL response_format the tables
    (sql_schema.tables_prompt) in the system turn, so the model knows the names the grammar admits."""
    messages = _template_messages(body.messages, fmt.arguments_as_text)
    fmt = body.response_format
    if fmt is not None and fmt.type == "sql" and fmt.sql is not None:
        line = tables_prompt(fmt.sql.tables)
        if messages and messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{line}".lstrip()}
        else:
            messages.insert(0, {"role": "system", "content": line})
    return messages


def call_id() -> str:
    return "call_" + random_hex()


def _message(text: str, calls: list[ToolCall], reasoning: str = "") -> dict:
    """The assistant message; `reasoning_content` (the field OpenAI-compatible servers use) when the model's
    family writes its reasoning apart (harmony's analysis channel)."""
    tool_calls = [{"id": call_id(), "type": "function",
                   "function": {"name": c.name, "arguments": dumps_args(c.arguments)}} for c in calls]
    message = {"role": "assistant", "content": text if (text or not calls) else None,
               "tool_calls": tool_calls or None, "refusal": None}
    return {**message, "reasoning_content": reasoning} if reasoning else message


def _enforcement(fin: Finished) -> dict:
    """JSON Schema outputs: how each keyword was enforced (grammar / validation / annotation)."""
    return {"enforcement": fin.enforcement} if fin.enforcement is not None else {}


def shape(rid: str, created: int, results: list[tuple[str, list[ToolCall], Finished]], fingerprint: str,
          model: str, prompt_tokens: int) -> dict:
    choices = [{"index": i, "message": _message(text, calls, fin.reasoning), "finish_reason": fin.reason, "logprobs": None}
               for i, (text, calls, fin) in enumerate(results)]
    completion = sum(f.completion_tokens for _, _, f in results)
    ext = {"choices": [{"decisions": [d.to_dict() for d in f.decisions],
                        "validations": [v.to_dict() for v in f.validations],
                        "retries": f.retries, **_enforcement(f)} for _, _, f in results]}
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": usage_of(prompt_tokens, completion, max(f.cached_tokens for _, _, f in results)),
            "system_fingerprint": fingerprint, "moegate": ext}


class ChatChunker(Chunker):
    """SSE chunks of one streamed choice (`chat.completion.chunk`)."""

    object = "chat.completion.chunk"

    def _chunk(self, delta: dict, finish: str | None = None, **extra) -> dict:
        return {**self.base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
                **extra}

    def start(self) -> dict:
        return self._chunk({"role": "assistant", "content": ""})

    def text(self, text: str) -> dict:
        return self._chunk({"content": text})

    def reasoning(self, text: str) -> dict:
        return self._chunk({"reasoning_content": text})

    def tool_call(self, index: int, call: ToolCall) -> list[dict]:
        head = {"index": index, "id": call_id(), "type": "function", "function": {"name": call.name, "arguments": ""}}
        return [self._chunk({"tool_calls": [head]}),
                self._chunk({"tool_calls": [{"index": index, "function": {"arguments": dumps_args(call.arguments)}}]})]

    def finish(self, fin: Finished) -> dict:
        ext = {"decisions": [d.to_dict() for d in fin.decisions], "validations": [v.to_dict() for v in fin.validations],
               "retries": fin.retries, **_enforcement(fin)}
        return self._chunk({}, fin.reason, moegate=ext)


@router.post(ROUTE, response_model=ChatCompletion, responses=_ERRORS)
async def chat_completions(body: ChatCompletionRequest, request: Request, state: State, tenant: TenantDep):
    """OpenAI chat completions; `response_format.type = "sql"` is moegate's SQL extension."""
    body.reject_invalid_unicode()
    rp = resolve_policy(state, tenant, ROUTE, body.model)
    if body.stream and body.n > 1:
        raise bad_request("n > 1 is not supported with stream=true", "n", "unsupported_parameter")
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    tok = state.llm.tokenizer
    try:
        # the checkpoint's own template; one without any gets its family's (the tool format's)
        fmt = state.generator.tool_format
        fallback = fmt.chat_template() if tok.chat_template is None else None
        prompt_text = tok.apply_chat_template(_prompt_messages(body, fmt), tools=tools or None, chat_template=fallback)
    except ChatTemplateError as e:
        raise bad_request(f"cannot render the conversation: {e}", "messages") from None
    prompt_ids = tok.encode(prompt_text)
    requested = body.max_completion_tokens or body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    max_tokens = budget(state, rp, len(prompt_ids), requested, param)
    try:
        plan = chat_plan(body, prompt_ids, rp, state.generator.tok, state.llm.engine.model_config.vocab_size,
                         max_tokens, state.generator.tool_format)
        fences = SegmentFences(plan.tools)
        if body.moegate is not None and body.moegate.sql is not None:
            fences.sql = sql_target(body.moegate.sql, rp)
    except PolicyDenied as e:
        raise policy_error(e) from None
    rid = new_id("chatcmpl")
    job = Job(ROUTE, "chat", body.model, plan, body.stream,
              bool(body.stream_options and body.stream_options.include_usage),
              audit_input=json.dumps([m.model_dump(exclude_none=True) for m in body.messages], ensure_ascii=False),
              fences=fences, chunker=ChatChunker,
              extra={"user": body.user} if body.user else {},
              shape=lambda rid, created, results, fp: shape(rid, created, results, fp, body.model, len(prompt_ids)))
    return await serve(state, request, tenant, rp, job, rid)

