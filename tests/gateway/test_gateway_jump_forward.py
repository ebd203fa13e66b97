"""Jump-forward through the gateway: the same json_schema and tool-call responses with the policy's
`decoding.jump_forward_tokens` at 0 and at 32 (demo model, greedy and seeded sampling), and the forced
tokens counted in /metrics."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.gateway.conftest import KEY_ALPHA, POLICY, free_port, serve_in_thread

DEMO = Path(__file__).parents[2] / "engine" / "assets" / "demo-moe"
ORDER = {"type": "object", "properties": {
    "symbol": {"type": "string", "maxLength": 5}, "side": {"enum": ["buy", "sell"]},
    "quantity": {"type": "integer", "minimum": 1}}, "required": ["symbol", "side", "quantity"],
    "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "place_order", "parameters": ORDER}}]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    from gateway.settings import Settings

    running = {}
    for jf in (0, 32):
        tmp = tmp_path_factory.mktemp(f"jf{jf}")
        (tmp / "policy.yaml").write_text(POLICY + f"decoding: {{jump_forward_tokens: {jf}}}\n")
        settings = Settings(model=str(DEMO), policy_path=str(tmp / "policy.yaml"), port=free_port(), device="cpu",
                            kv_cache_gib=0.05, state_dir=tmp / "state", otlp_endpoint=None)
        running[jf] = serve_in_thread(settings)
    yield {jf: url for jf, (_, _, _, url) in running.items()}
    for server, thread, _, _ in running.values():
        server.should_exit = True
        thread.join(30)


def _chat(url: str, **body) -> dict:
    body = {"model": "moegate-demo", "messages": [{"role": "user", "content": "Buy 100 AAPL now."}],
            "max_tokens": 64, **body}
    r = httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY_ALPHA}"},
                   timeout=120)
    r.raise_for_status()
    return r.json()["choices"][0]["message"]


def _forced(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    line = next(x for x in text.splitlines() if x.startswith('moegate_multi_token_tokens{counter="forced_tokens"}'))
    return float(line.split()[-1])


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.7, "seed": 5}])
def test_jump_forward_answers_the_same_bytes(servers, sampling):
    schema = {"type": "json_schema", "json_schema": {"name": "order", "strict": True, "schema": ORDER}}
    plain = [_chat(servers[0], response_format=schema, **sampling),
             _chat(servers[0], tools=TOOLS, tool_choice="required", **sampling)]
    forced = [_chat(servers[32], response_format=schema, **sampling),
              _chat(servers[32], tools=TOOLS, tool_choice="required", **sampling)]
    assert forced[0]["content"] == plain[0]["content"]
    json.loads(plain[0]["content"])
    assert [c["function"] for c in forced[1]["tool_calls"]] == [c["function"] for c in plain[1]["tool_calls"]]
    assert _forced(servers[32]) > 0 and _forced(servers[0]) == 0


def test_jump_forward_inside_a_tool_call_segment(servers):
    """tool_choice auto: the call opens inside free text (exploration), its arguments run in execution under the
    segment's constraint, where the forced tokens jump forward; the response is the same bytes."""
    before = _forced(servers[32])
    plain = _chat(servers[0], tools=TOOLS, tool_choice="auto", temperature=0)
    forced = _chat(servers[32], tools=TOOLS, tool_choice="auto", temperature=0)
    assert plain["tool_calls"], plain  # the demo model calls the tool here
    assert forced["content"] == plain["content"]
    assert [c["function"] for c in forced["tool_calls"]] == [c["function"] for c in plain["tool_calls"]]
    assert _forced(servers[32]) > before
