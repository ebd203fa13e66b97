"""The gateway's bounded strict retry on a keyword only validation enforces (uniqueItems), driven by a
scripted model: its logits favour one text per attempt and the real constraint masks them."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import torch

from gateway.classify import Decision
from gateway.events import Finished, TextDelta
from gateway.generation import Generator
from gateway.plan import Plan
from gateway.retry import RETRY_TEMPERATURE
from gateway.structured.build import json_schema_spec
from gateway.structured.validate import validate_json

SCHEMA = {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 2, "maxItems": 2, "uniqueItems": True}


class ScriptedLLM:
    """Per generate() call, logits that favour the next scripted text (then EOS); processors apply."""

    def __init__(self, tokinfo, scripts: list[str]):
        self.tokinfo, self.scripts, self.params = tokinfo, list(scripts), []
        self.tokenizer = SimpleNamespace(decode=tokinfo.decode)
        self.engine = SimpleNamespace(eos_token_ids=set(tokinfo.eos_ids))

    async def generate(self, rid, prompt_ids, params, mode, cache_salt="", final_only=False):  # one output, finished
        self.params.append(params)
        target = self.tokinfo.encode(self.scripts.pop(0)) + [self.tokinfo.eos_ids[0]]
        ids: list[int] = []
        for want in target:
            logits = torch.zeros(self.tokinfo.vocab_size)
            logits[want] = 10.0
            for proc in params.logits_processors:
                logits = proc(ids, logits)
            ids.append(int(torch.argmax(logits)))
            if ids[-1] in self.tokinfo.eos_ids:
                break
        text = self.tokinfo.decode([t for t in ids if t not in self.tokinfo.eos_ids])  # the engine makes the text
        yield SimpleNamespace(token_ids=ids, text=text, finished=True, finish_reason="stop", cache_hits={},
                              num_cached_tokens=0)


def _plan(temperature: float) -> Plan:
    return Plan(prompt_ids=[1], max_tokens=256, temperature=temperature, top_p=1.0, top_k=0, seed=5, stop=[],
                logit_bias={}, n=1, decision=Decision("execution", "request:json_schema"), features=set(),
                segment_modes={}, kind="json", spec=json_schema_spec(SCHEMA),
                validate=lambda text: validate_json(text, SCHEMA))


async def _run(llm, plan) -> list:
    return [ev async for ev in Generator(llm, llm.tokinfo, strict_retries=1).run_structured(plan, "r1")]


def test_unique_items_violation_is_regenerated(tokinfo):
    llm = ScriptedLLM(tokinfo, ['["a","a"]', '["a","b"]'])
    events = asyncio.run(_run(llm, _plan(temperature=0.0)))
    text, fin = events[0], events[-1]
    assert isinstance(text, TextDelta) and text.text == '["a","b"]'
    assert isinstance(fin, Finished) and fin.retries == 1
    assert [v.ok for v in fin.validations] == [False, True] and "non-unique" in fin.validations[0].error
    assert fin.enforcement["keywords"]["uniqueItems"] == "validation"
    # the failed attempt was greedy, so the retry samples (seeded) instead of repeating it
    assert llm.params[0].temperature == 0.0 and llm.params[1].temperature == RETRY_TEMPERATURE
    assert llm.params[1].seed is not None


def test_retry_after_a_sampled_attempt_is_greedy(tokinfo):
    llm = ScriptedLLM(tokinfo, ['["b","b"]', '["b","a"]'])
    fin = asyncio.run(_run(llm, _plan(temperature=0.9)))[-1]
    assert fin.retries == 1 and llm.params[1].temperature == 0.0
