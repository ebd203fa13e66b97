"""The gateway over a real redis-server paused with SIGSTOP: fail_open keeps answering, a reload to fail_closed
(and new circuit settings) is applied to the running store and answers 503 with a message, through the
openai client; a reload that changes the redis timeout is rejected."""

from __future__ import annotations

import os

import httpx
import openai
import pytest

from tests.gateway.conftest import KEY_ALPHA, POLICY, free_port, serve_in_thread

pytestmark = pytest.mark.redis


def _write(path, text: str) -> None:
    path.write_text(text)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def test_hung_redis_degrades_per_policy(tiny_checkpoint, redis_server, tmp_path):

    from gateway.settings import Settings

    policy = tmp_path / "policy.yaml"
    limited = POLICY.replace("  max_tokens: 256", "  max_tokens: 256\n  requests_per_min: 100000\n  concurrency: 100")
    policy.write_text(limited)
    settings = Settings(model=str(tiny_checkpoint()), policy_path=str(policy), port=free_port(), device="cpu",
                        kv_cache_gib=0.05, state_dir=tmp_path / "state", redis_url=redis_server.url)
    server, thread, app, _ = serve_in_thread(settings)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{settings.port}/v1", api_key=KEY_ALPHA, max_retries=0,
                           timeout=60)

    def ask():
        return client.chat.completions.create(model="moegate-demo", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2)

    state = app.state.moegate
    try:
        ask()
        assert state.store.available and state.store.breaker.state == "closed"
        redis_server.pause()
        for _ in range(5):  # fail_open: answered, limits unchecked
            assert ask().choices[0].finish_reason in ("stop", "length")
        assert state.store.breaker.state == "open" and state.store.breaker.skipped > 0
        assert httpx.get(f"http://127.0.0.1:{settings.port}/health").json()["store_circuit"] == "open"

        _write(policy, limited.replace("on_unavailable: fail_open", "on_unavailable: fail_open, timeout_s: 2"))
        state.policies.reload()
        assert "stores.timeout_s" in str(state.policies.last_error) and state.store.on_unavailable == "fail_open"

        _write(policy, limited.replace("on_unavailable: fail_open",
                                       "on_unavailable: fail_closed, circuit_failures: 5, circuit_cooldown_s: 60"))
        state.policies.reload()
        assert state.policies.last_error is None and state.store.on_unavailable == "fail_closed"
        assert (state.store.breaker.threshold, state.store.breaker.cooldown_s) == (5, 60)
        with pytest.raises(openai.APIStatusError) as err:
            ask()
        assert err.value.status_code == 503 and "circuit open after 5" in str(err.value) and "fail_closed" in str(err.value)
    finally:
        redis_server.resume()
        server.should_exit = True
        thread.join(30)
