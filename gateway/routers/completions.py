"""POST /v1/completions: raw prompt completion (text_completion objects), stream or not."""

from __future__ import annotations

from fastapi import APIRouter, Request

from gateway.deps import State, TenantDep
from gateway.errors import bad_request
from gateway.events import Finished, ToolCall
from gateway.plan import completion_plan
from gateway.schemas import Completion, CompletionRequest, ErrorBody, new_id
from gateway.serving import Job, budget, resolve_policy, serve
from gateway.sse import Chunker, usage_of

ROUTE = "/v1/completions"
router = APIRouter()
_ERRORS = {s: {"model": ErrorBody} for s in (400, 401, 403, 404, 413, 429, 500, 503, 504)}


def shape(rid: str, created: int, results: list[tuple[str, list[ToolCall], Finished]], fingerprint: str,
          model: str, prompt_tokens: int) -> dict:
    completion = sum(f.completion_tokens for _, _, f in results)
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": i, "text": text, "finish_reason": fin.reason, "logprobs": None}
                        for i, (text, _, fin) in enumerate(results)],
            "usage": usage_of(prompt_tokens, completion, max(f.cached_tokens for _, _, f in results)),
            "system_fingerprint": fingerprint,
            "moegate": {"choices": [{"decisions": [d.to_dict() for d in f.decisions]} for _, _, f in results]}}


class CompletionChunker(Chunker):
    object = "text_completion"

    def _chunk(self, text: str, finish: str | None = None) -> dict:
        return {**self.base, "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}

    def start(self) -> dict:
        return self._chunk("")

    def text(self, text: str) -> dict:
        return self._chunk(text)

    def tool_call(self, index: int, call: ToolCall) -> list[dict]:
        raise AssertionError("completions never produce tool calls")

    def finish(self, fin: Finished) -> dict:
        return self._chunk("", fin.reason)


@router.post(ROUTE, response_model=Completion, responses=_ERRORS)
async def completions(body: CompletionRequest, request: Request, state: State, tenant: TenantDep):
    body.reject_invalid_unicode()
    rp = resolve_policy(state, tenant, ROUTE, body.model)
    if body.stream and body.n > 1:
        raise bad_request("n > 1 is not supported with stream=true", "n", "unsupported_parameter")
    tok = state.llm.tokenizer
    prompt = body.prompt[0] if isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], str) \
        else body.prompt
    if isinstance(prompt, list):
        vocab = state.llm.engine.model_config.vocab_size
        if not prompt or any(not 0 <= t < vocab for t in prompt):
            raise bad_request(f"prompt token ids must be in [0, {vocab})", "prompt")
        prompt_ids, prompt_text = list(prompt), ""
    else:
        prompt_ids, prompt_text = tok.encode(prompt), prompt
    if not prompt_ids:
        raise bad_request("the prompt is empty", "prompt")
    max_tokens = budget(state, rp, len(prompt_ids), body.max_tokens, "max_tokens")
    plan = completion_plan(body, prompt_ids, rp, state.llm.engine.model_config.vocab_size, max_tokens)
    rid = new_id("cmpl")
    job = Job(ROUTE, "text_completion", body.model, plan, body.stream,
              bool(body.stream_options and body.stream_options.include_usage),
              audit_input=prompt_text or str(prompt_ids), chunker=CompletionChunker,
              extra={"user": body.user} if body.user else {},
              shape=lambda rid, created, results, fp: shape(rid, created, results, fp, body.model, len(prompt_ids)))
    return await serve(state, request, tenant, rp, job, rid)
