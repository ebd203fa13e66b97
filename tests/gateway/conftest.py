"""A real gateway on loopback (uvicorn in a thread, or a `moegate serve` process) over a tiny random checkpoint and a
test policy."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from evals.perf.common import free_port, serve_in_thread  # noqa: F401 (re-exported for the tests)
from policies.model import hash_api_key

KEY_ALPHA, KEY_BETA, KEY_GAMMA = "sk-test-alpha-0123456789", "sk-test-beta-0123456789", "sk-test-gamma-0123456789"
POLICY = f"""
version: 1
id: gateway-test
models:
  - name: moegate-demo
routes:
  - path: /v1/chat/completions
  - path: /v1/completions
tenants:
  - id: alpha
    api_keys: [{{hash: "{hash_api_key(KEY_ALPHA)}"}}]
    allowed_tools: ["*"]
    databases: [market]
  - id: beta
    api_keys: [{{hash: "{hash_api_key(KEY_BETA)}"}}]
    routes: [/v1/completions]
    allowed_tools: [get_quote]
  - id: gamma
    api_keys: [{{hash: "{hash_api_key(KEY_GAMMA)}"}}]
    limits: {{requests_per_min: 2, request_burst: 2}}
modes:
  exploration: {{precision: fast, deferral_depth: 2}}
  execution: {{precision: fast, deferral_depth: 0}}
precision_profiles:
  fast: {{routed_experts: int4}}
databases:
  market: {{dialect: sqlite, allowed_tables: [prices], row_limit: 100}}
limits:
  max_tokens: 256
audit: {{level: full, fsync: never}}
stores: {{on_unavailable: fail_open}}
"""


ROOT = Path(__file__).resolve().parents[2]


def serve_process(args: list[str], env: dict, timeout_s: float = 120.0) -> tuple[subprocess.Popen, str]:
    """`moegate serve ARGS --port P` as a real process, answering /health -> (process, base url); the caller
    terminates it. `env` gets PYTHONPATH pointing at this checkout."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", *args, "--port", str(port)],
                            env={**env, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"moegate serve exited {proc.returncode}: {proc.stdout.read().decode()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"moegate serve did not answer within {timeout_s:.0f} s")
        try:
            httpx.get(url + "/health", timeout=2).raise_for_status()
            return proc, url
        except httpx.HTTPError:
            time.sleep(0.3)


@dataclass
class Server:
    url: str
    app: object
    state_dir: Path
    key_alpha: str = KEY_ALPHA  # tenant alpha: every tool, database `market`
    key_beta: str = KEY_BETA  # tenant beta: /v1/completions only, tool get_quote
    key_gamma: str = KEY_GAMMA  # tenant gamma: 2 requests per minute

    @property
    def state(self):
        return self.app.state.moegate

    def audit_records(self) -> list[dict]:
        """Every record of the server's audit log, oldest first."""
        import json

        return [json.loads(line) for line in (self.state_dir / "audit.jsonl").read_bytes().splitlines()]

    def client(self, key: str = KEY_ALPHA, **kw):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=60, **kw)


@pytest.fixture(scope="session")
def gateway_server(tiny_checkpoint, tmp_path_factory) -> Server:

    from gateway.settings import Settings

    tmp = tmp_path_factory.mktemp("gateway")
    (tmp / "policy.yaml").write_text(POLICY)
    settings = Settings(model=str(tiny_checkpoint()), policy_path=str(tmp / "policy.yaml"), port=free_port(),
                        device="cpu", kv_cache_gib=0.05, max_queue=3, max_request_bytes=100_000,
                        request_timeout_s=60, state_dir=tmp / "state", otlp_endpoint=None)
    server, thread, app, url = serve_in_thread(settings)
    yield Server(url, app, tmp / "state")
    server.should_exit = True
    thread.join(30)
