"""`moegate serve`: a clear error without a model; with --model, a real process that answers /health."""

from __future__ import annotations

import os

import httpx

from gateway.cli import main
from tests.gateway.conftest import serve_process


def test_serve_without_a_model_explains_what_to_do(monkeypatch, tmp_path, capsys):
    import gateway.settings

    monkeypatch.setattr(gateway.settings, "DEMO_MODEL_DIR", tmp_path / "missing-demo")
    monkeypatch.delenv("MOEGATE_MODEL", raising=False)
    assert main(["serve"]) == 2
    err = capsys.readouterr().err
    assert "--model" in err and "moegate model init-random" in err


def test_serve_process_answers(tiny_checkpoint, tmp_path):
    proc, url = serve_process(["--model", str(tiny_checkpoint()), "--device", "cpu", "--log-level", "warning"],
                              {**os.environ, "MOEGATE_STATE_DIR": str(tmp_path)}, timeout_s=90)
    try:
        health = httpx.get(url + "/health", timeout=2).json()
        assert health["status"] == "ok" and health["policy_id"] == "dev"
        r = httpx.post(url + "/v1/chat/completions", headers={"Authorization": "Bearer anything"},
                       json={"model": "moegate-demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200 and r.json()["object"] == "chat.completion"  # embedded policy: any key
        assert (tmp_path / "audit.jsonl").exists()
    finally:
        proc.terminate()
        proc.wait(30)


def test_serve_a_gguf_file(tiny_checkpoint, tmp_path):
    """`moegate serve --model FILE.gguf`: config, tokenizer and chat template from the GGUF alone."""
    from modeltools.gguf_write import write_gguf

    src, model_dir = tiny_checkpoint(), tmp_path / "gguf"
    model_dir.mkdir()
    write_gguf(src, model_dir / "model.gguf", "Q8_0")
    proc, url = serve_process(["--model", str(model_dir / "model.gguf"), "--device", "cpu", "--log-level", "warning"],
                              {**os.environ, "MOEGATE_STATE_DIR": str(tmp_path / "state")}, timeout_s=90)
    try:
        r = httpx.post(url + "/v1/chat/completions", headers={"Authorization": "Bearer anything"},
                       json={"model": "moegate-demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.terminate()
        proc.wait(30)


def test_serve_qwen3_next(tiny_checkpoint, tmp_path):
    """`moegate serve --model DIR` with a Qwen3-Next checkpoint: linear-attention layers and their recurrent state."""
    model = tiny_checkpoint("qwen3_next")
    proc, url = serve_process(["--model", str(model), "--device", "cpu", "--log-level", "warning"],
                              {**os.environ, "MOEGATE_STATE_DIR": str(tmp_path)}, timeout_s=90)
    try:
        ask = {"model": "moegate-demo", "messages": [{"role": "user", "content": "Quote AAPL"}], "max_tokens": 4,
               "temperature": 0}
        first, again = (httpx.post(url + "/v1/chat/completions", headers={"Authorization": "Bearer anything"},
                                   json=ask, timeout=60) for _ in range(2))
        assert first.status_code == again.status_code == 200
        assert first.json()["usage"]["completion_tokens"] >= 1
        # the second request may reuse the first's prompt blocks and state: the same greedy reply
        assert again.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
    finally:
        proc.terminate()
        proc.wait(30)
