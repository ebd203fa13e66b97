"""Binding a whole-output constraint from the event loop: a cached compile on the loop, a compile in a thread."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from gateway import generation
from gateway.structured.build import json_schema_spec
from gateway.structured.cache import default_cache
from gateway.structured.vocab import TokenizerInfo

DEMO = Path(__file__).resolve().parents[2] / "engine" / "assets" / "demo-moe"


def test_a_cached_compile_binds_on_the_loop_and_a_compile_runs_in_a_thread(monkeypatch):
    tok = TokenizerInfo.from_file(DEMO / "tokenizer.json", [0])
    # a schema no other test compiles: the first bind compiles it
    spec = json_schema_spec({"type": "object", "properties": {"bind_test_only": {"type": "integer"}},
                             "required": ["bind_test_only"], "additionalProperties": False})
    built_on = []
    build = generation.build_constraint
    monkeypatch.setattr(generation, "build_constraint",
                        lambda *a, **k: (built_on.append(threading.current_thread()), build(*a, **k))[1])
    assert default_cache().compiled(spec, tok) is None

    async def bind():
        return await generation.bind_constraint(spec, tok, eos_ids=[0], max_tokens=16)

    first, second = asyncio.run(bind()), asyncio.run(bind())
    assert [t is threading.main_thread() for t in built_on] == [False, True]
    assert default_cache().compiled(spec, tok) is first.compiled is second.compiled
    assert first is not second and first.matcher is not second.matcher  # one constraint per sequence
