"""Server-sent events: the OpenAI `usage` object, a route's chunk builder (`Chunker`), SSE framing, and the
streaming response that settles its request when the client cuts it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import anyio
from fastapi.responses import StreamingResponse

from gateway.events import Finished, ToolCall


def usage_of(prompt: int, completion: int, cached: int = 0) -> dict:
    """The OpenAI `usage` object; `cached`: prompt tokens the prefix cache served."""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


class Chunker:
    """Base of a route's SSE chunk builder (`Job.chunker`): the fields every chunk of one streamed choice
    carries, and the closing usage chunk. Subclasses name `object` and build start/text/tool_call/finish."""

    object = ""

    def __init__(self, rid: str, created: int, model: str, fingerprint: str):
        self.base = {"id": rid, "object": self.object, "created": created, "model": model,
                     "system_fingerprint": fingerprint}

    def usage(self, prompt: int, completion: int, cached: int = 0) -> dict:
        return {**self.base, "choices": [], "usage": usage_of(prompt, completion, cached)}


def sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n".encode()


@dataclass
class Sent:
    """What a stream has handed to the client so far."""

    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    fin: Finished | None = None
    chunks: int = 0


class ClosingStream(StreamingResponse):
    """An SSE response that closes its generator, then runs `on_close`, before returning: also when the client
    cut it while a chunk was in flight, or before the first one, so the request is settled (audit record,
    admission released) before it ends."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable, **kw):
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
                await self.on_close()
