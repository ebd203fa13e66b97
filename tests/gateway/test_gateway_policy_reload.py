"""Hot reload against the running server: a policy it cannot take is rejected with a message (the old one
stays and keeps serving); a deferral change is applied to the running engine between two steps."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import pytest

from tests.gateway.conftest import KEY_ALPHA, POLICY, free_port, serve_in_thread


def _write(path: Path, text: str) -> None:
    path.write_text(text)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):

    from gateway.settings import Settings

    tmp = tmp_path_factory.mktemp("reload")
    policy = tmp / "policy.yaml"
    policy.write_text(POLICY)
    settings = Settings(model=str(tiny_checkpoint()), policy_path=str(policy), port=free_port(), device="cpu",
                        kv_cache_gib=0.05, state_dir=tmp / "state")
    srv, thread, app, url = serve_in_thread(settings)
    yield app, policy, url + "/v1"
    srv.should_exit = True
    thread.join(30)


def _ask(url: str) -> str:
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key=KEY_ALPHA, max_retries=0, timeout=60)
    reply = client.chat.completions.create(model="moegate-demo", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=2)
    return reply.system_fingerprint


ONLY_OTHER_ROUTES = [("- name: moegate-demo\n", "- name: moegate-demo\n  - name: other\n"),
                     ("  - path: /v1/chat/completions\n", "  - path: /v1/chat/completions\n    models: [other]\n"),
                     ("  - path: /v1/completions\n", "  - path: /v1/completions\n    models: [other]\n")]


@pytest.mark.parametrize("edits, field, words", [
    ([("- name: moegate-demo", "- name: other-model")], "models", "does not list"),
    (ONLY_OTHER_ROUTES, "routes", "no tenant can reach the served model"),
    ([("fast: {routed_experts: int4}", "fast: {routed_experts: int8}")], "modes.exploration.precision",
     "routed_experts: int4 -> int8"),
    ([("audit: {level: full, fsync: never}", "audit: {level: full, fsync: always}")], "audit.fsync", "restart"),
    ([("audit: {level: full, fsync: never}", "audit: {level: full, fsync: never}\ndecoding: {speculative_tokens: 4}")],
     "decoding", "multi-token decoding is set at start"),
])
def test_reload_the_process_cannot_take_is_rejected(server, edits, field, words):
    app, policy, url = server
    holder = app.state.moegate.policies
    good = holder.current
    text = POLICY
    for old, new in edits:
        assert old in text
        text = text.replace(old, new)
    try:
        _write(policy, text)
        result = holder.reload()
        assert not result.changed and holder.current is good
        assert holder.last_error is not None and field in str(holder.last_error) and words in str(holder.last_error)
        _ask(url)  # the old policy keeps serving
        health = httpx.get(url.removesuffix("/v1") + "/health").json()
        assert health["policy_digest"] == good.digest and words in health["policy_reload_error"]
    finally:
        _write(policy, POLICY)
        holder.reload()
    assert holder.last_error is None


def test_reload_applies_deferral_to_the_running_engine(server):
    app, policy, url = server
    state = app.state.moegate
    holder, engine = state.policies, state.llm.engine
    assert engine.config.defer == 1  # the test policy asks 2, clamped to top_k/2 for a top-2 model
    before = _ask(url)
    assert before == state.fingerprints["exploration"]
    try:
        _write(policy, POLICY.replace("deferral_depth: 2", "deferral_depth: 0"))
        holder.reload()
        assert holder.current.modes.exploration.deferral_depth == 0 and holder.last_error is None
        deadline = time.monotonic() + 30  # applied by the engine thread at its next step boundary
        while state.fingerprints["exploration"] == before and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.config.defer == 0 and engine.runner.defer == 0
        assert state.fingerprints["exploration"] == engine.numerics_fingerprint("exploration")
        after = _ask(url)
        assert after == state.fingerprints["exploration"] != before
    finally:
        _write(policy, POLICY)
        holder.reload()


def test_source_change_is_rejected_only_when_the_policy_chose_the_checkpoint(tiny_checkpoint, tmp_path):
    from types import SimpleNamespace

    from gateway.policy_reload import PolicyReloads
    from gateway.settings import Settings
    from policies.loader import parse_policy

    ckpt = tiny_checkpoint()
    sourced = POLICY.replace("  - name: moegate-demo\n", f"  - name: moegate-demo\n    source: {ckpt}\n")
    moved = sourced.replace(f"source: {ckpt}", "source: /elsewhere")
    policy_path = tmp_path / "p.yaml"
    policy_path.write_text(sourced)
    from_policy = PolicyReloads(SimpleNamespace(settings=Settings(model=str(ckpt), policy_path=str(policy_path))),
                                top_k=2, device="cpu", fingerprint=None)
    issues = from_policy.check(parse_policy(moved), parse_policy(sourced))
    assert [i.field for i in issues] == ["models[0].source"] and "needs a restart" in issues[0].message

    other = tiny_checkpoint(seed=1)  # served from --model, not from the policy's source
    overridden = PolicyReloads(SimpleNamespace(settings=Settings(model=str(other), policy_path=str(policy_path))),
                               top_k=2, device="cpu", fingerprint=None)
    assert overridden.check(parse_policy(moved), parse_policy(sourced)) == []


@pytest.mark.parametrize(("device", "expected"), [("cpu", 0), ("cuda", 1)])
def test_auto_deferral_defers_only_where_a_gpu_overlaps_the_experts(device, expected):
    from gateway.policy_reload import AUTO_DEFERRAL_DEPTH, deferral_for
    from policies.loader import parse_policy

    auto = parse_policy(POLICY.replace("deferral_depth: 2}", "deferral_depth: auto}"))
    assert auto.modes.exploration.deferral_depth == "auto" and AUTO_DEFERRAL_DEPTH == 1
    assert deferral_for(auto, top_k=8, device=device) == expected
    assert deferral_for(parse_policy(POLICY), top_k=8, device=device) == 2  # an explicit depth is kept
    assert deferral_for(parse_policy(POLICY), top_k=2, device=device) == 1  # within top_k // 2


def test_auto_is_not_a_depth_for_execution():
    from policies.loader import PolicyError, parse_policy

    with pytest.raises(PolicyError, match="execution mode must not defer"):
        parse_policy(POLICY.replace("deferral_depth: 0}", "deferral_depth: auto}"))
