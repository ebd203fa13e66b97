"""Requests that send no temperature take the policy's default for their mode; an explicit one wins."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from policies.loader import load_policy, parse_policy

EXAMPLES = Path(__file__).resolve().parents[2] / "policies" / "examples"


def _audited_params(server, request_id: str) -> dict:
    for line in (server.state_dir / "audit.jsonl").read_text().splitlines():
        data = json.loads(line)["data"]
        if data.get("request_id") == request_id:
            return data["params"]
    raise AssertionError(f"no audit record for {request_id}")


@pytest.mark.parametrize("name, tenant", [("dev.yaml", "dev"), ("finance.yaml", "risk")])
def test_shipped_policies_decode_execution_greedily(name, tenant):
    policy = load_policy(EXAMPLES / name)
    rp = policy.resolve(tenant, "/v1/chat/completions", "moegate-demo")
    assert rp.temperature == {"exploration": 1.0, "execution": 0.0}


def test_policy_sets_each_modes_default():
    text = (EXAMPLES / "dev.yaml").read_text()
    assert "deferral_depth: auto}" in text and "temperature: 0}" in text
    text = text.replace("deferral_depth: auto}", "deferral_depth: auto, temperature: 0.6}", 1)
    text = text.replace("temperature: 0}", "temperature: 0.2}")
    policy = parse_policy(text)
    rp = policy.resolve("dev", "/v1/chat/completions", "moegate-demo")
    assert rp.temperature == {"exploration": 0.6, "execution": 0.2}
    unset = parse_policy(text.replace(", temperature: 0.6", "").replace(", temperature: 0.2", ""))
    assert unset.resolve("dev", "/v1/chat/completions", "moegate-demo").temperature == \
        {"exploration": 1.0, "execution": 0.0}


def test_execution_request_defaults_to_the_policy_temperature(gateway_server):
    """The test policy sets no temperature: execution decodes greedily (0), exploration samples at 1."""
    client = gateway_server.client()
    fmt = {"type": "json_object"}
    msgs = [{"role": "user", "content": "Buy 10 AAPL as JSON"}]
    first = client.chat.completions.create(model="moegate-demo", messages=msgs, response_format=fmt, max_tokens=12)
    second = client.chat.completions.create(model="moegate-demo", messages=msgs, response_format=fmt, max_tokens=12)
    assert _audited_params(gateway_server, first.id)["temperature"] == 0.0
    assert first.choices[0].message.content == second.choices[0].message.content  # greedy: no seed needed

    explicit = client.chat.completions.create(model="moegate-demo", messages=msgs, response_format=fmt,
                                              max_tokens=4, temperature=0.7, seed=1)
    assert _audited_params(gateway_server, explicit.id)["temperature"] == 0.7

    free = client.chat.completions.create(model="moegate-demo", messages=msgs, max_tokens=4)
    assert _audited_params(gateway_server, free.id)["temperature"] == 1.0
