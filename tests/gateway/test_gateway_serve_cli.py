"""`moegate serve`: a clear error without a model; with --model, a real process that answers /health."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from gateway.cli import main


def test_serve_without_a_model_explains_what_to_do(monkeypatch, tmp_path, capsys):
    import gateway.settings

    monkeypatch.setattr(gateway.settings, "DEMO_MODEL_DIR", tmp_path / "missing-demo")
    monkeypatch.delenv("MOEGATE_MODEL", raising=False)
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert "--model" in err and "moegate model init-random" in err


def test_serve_process_answers(tiny_checkpoint, tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), "MOEGATE_STATE_DIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--model", str(tiny_checkpoint()),
                             "--port", str(port), "--device", "cpu", "--log-level", "warning"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()
                break
            except httpx.HTTPError:
                time.sleep(0.3)
        else:
            raise AssertionError("moegate serve did not answer within 90 s")
        assert health["status"] == "ok" and health["policy_id"] == "dev"
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", headers={"Authorization": "Bearer anything"},
                       json={"model": "moegate-demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200 and r.json()["object"] == "chat.completion"  # embedded policy: any key
        assert (tmp_path / "audit.jsonl").exists()
    finally:
        proc.terminate()
        proc.wait(30)
