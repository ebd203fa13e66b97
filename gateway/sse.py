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
        self._frames: dict[str, tuple[bytes, bytes] | None] = {}

    def text_sse(self, text: str) -> bytes:
        """`sse(self.text(text))`, byte for byte, from a frame serialised once per stream."""
        return self._framed("text", text)

    def reasoning_sse(self, text: str) -> bytes:
        """`sse(self.reasoning(text))`, byte for byte (chunkers whose family writes reasoning apart)."""
        return self._framed("reasoning", text)

    def _framed(self, builder: str, text: str) -> bytes:
        """The SSE event of `getattr(self, builder)(text)`: its JSON around the text is the same for every chunk of
        the stream, so it is serialised once (with a marker where the text goes) and only the text per chunk."""
        if builder not in self._frames:
            parts = sse(getattr(self, builder)(_MARKER)).split(_MARKER_JSON)
            # a field that held the marker too (a client-chosen name) would be ambiguous: serialise each chunk
            self._frames[builder] = (parts[0], parts[1]) if len(parts) == 2 else None
        frame = self._frames[builder]
        if frame is None:
            return sse(getattr(self, builder)(text))
        return frame[0] + json.dumps(text, ensure_ascii=False).encode() + frame[1]

    def usage(self, prompt: int, completion: int, cached: int = 0) -> dict:
        return {**self.base, "choices": [], "usage": usage_of(prompt, completion, cached)}


_MARKER = "\x00moegate:text\x00"  # where a chunk frame's text goes
_MARKER_JSON = json.dumps(_MARKER).encode()


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
