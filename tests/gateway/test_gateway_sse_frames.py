"""SSE chunk frames: a streamed text chunk serialised from its per-stream frame is the chunk builder's JSON, byte
for byte."""

from __future__ import annotations

import pytest

from gateway.routers.chat import ChatChunker
from gateway.routers.completions import CompletionChunker
from gateway.sse import _MARKER, sse

TEXTS = ["", "a", " the", '{"symbol": "AAPL", "qty": 10}', "line\nbreak\ttab\r", 'quote " and \\ backslash',
         "naïve café 日本語 🙂", "\x00\x1f\x7f", "\u2028\u2029", _MARKER, "</script>"]


@pytest.mark.parametrize("chunker", [ChatChunker, CompletionChunker])
@pytest.mark.parametrize("model", ["moegate-demo", f"odd{_MARKER}name", 'q"uote'])
def test_text_frames_are_the_builders_json(chunker, model):
    c = chunker("chatcmpl-1", 1_700_000_000, model, "fp_abc")
    for text in TEXTS * 2:  # the second pass reads the kept frame
        assert c.text_sse(text) == sse(c.text(text))


def test_reasoning_frame_is_the_builders_json():
    c = ChatChunker("chatcmpl-2", 1, "moegate-demo", "fp")
    for text in TEXTS:
        assert c.reasoning_sse(text) == sse(c.reasoning(text))
        assert c.text_sse(text) == sse(c.text(text))  # each builder keeps its own frame


def test_unencodable_text_fails_as_the_builder_does():
    c = ChatChunker("chatcmpl-3", 1, "moegate-demo", "fp")
    with pytest.raises(UnicodeEncodeError):
        sse(c.text("\ud800"))
    with pytest.raises(UnicodeEncodeError):
        c.text_sse("\ud800")
