"""`moegate serve --config P` serves the model P lists, from its `source`; flags override, never repeat it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.settings import DEMO_MODEL_DIR, ModelNotFound, from_env
from policies.model import hash_api_key
from tests.gateway.conftest import serve_process

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-policy-models-0123456789"


def _policy(models: list[tuple[str, str | None]]) -> str:
    listed = "\n".join(f"  - name: {n}" + (f"\n    source: {s}" if s is not None else "") for n, s in models)
    return f"""version: 1
id: sources
models:
{listed}
routes:
  - path: /v1/chat/completions
tenants:
  - id: t
    api_keys: [{{hash: "{hash_api_key(KEY)}"}}]
modes:
  exploration: {{precision: fast}}
  execution: {{precision: fast, temperature: 0}}
precision_profiles:
  fast: {{routed_experts: int8}}
audit: {{fsync: never}}
"""


@pytest.fixture(scope="module")
def init_random_checkpoint(tmp_path_factory) -> Path:
    """A checkpoint made by the project's own tooling: `moegate model init-random --preset tiny`."""
    out = tmp_path_factory.mktemp("ckpt") / "big"
    assert main(["model", "init-random", "--preset", "tiny", "--out", str(out)]) == 0
    return out


def _env(tmp_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("MOEGATE_MODEL", "MOEGATE_POLICY", "REDIS_URL")}
    return {**env, "PYTHONPATH": str(ROOT), "MOEGATE_STATE_DIR": str(tmp_path / "state")}


def test_policy_source_is_served_through_the_openai_client(init_random_checkpoint, tmp_path):
    from openai import OpenAI

    # a relative source is read from the policy file's directory
    policy = init_random_checkpoint.parent / "policy.yaml"
    policy.write_text(_policy([("big", init_random_checkpoint.name)]))
    proc, url = serve_process(["--config", str(policy), "--device", "cpu", "--log-level", "warning"], _env(tmp_path))
    try:
        client = OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["big"]
        reply = client.chat.completions.create(model="big", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=3)
        assert reply.model == "big" and reply.choices[0].finish_reason in ("stop", "length")
    finally:
        proc.terminate()
        proc.wait(30)


def test_first_model_is_served_and_flags_override(init_random_checkpoint, tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("MOEGATE_MODEL", raising=False)
    monkeypatch.delenv("MOEGATE_POLICY", raising=False)
    policy = tmp_path / "p.yaml"
    policy.write_text(_policy([("big", str(init_random_checkpoint)), ("demo", "builtin:demo")]))
    with caplog.at_level("WARNING"):
        s = from_env(policy_path=str(policy), state_dir=tmp_path)
    assert (s.model, s.model_name) == (str(init_random_checkpoint), "big")
    assert "serves the first, 'big'" in caplog.text and "--model-name" in caplog.text

    if (DEMO_MODEL_DIR / "config.json").is_file():
        s = from_env(policy_path=str(policy), model_name="demo", state_dir=tmp_path)
        assert (s.model, s.model_name) == (str(DEMO_MODEL_DIR), "demo")

    other = tmp_path / "other"
    other.symlink_to(init_random_checkpoint)
    s = from_env(policy_path=str(policy), model=str(other), state_dir=tmp_path)  # --model replaces the source
    assert (s.model, s.model_name) == (str(other), "big")
    monkeypatch.setenv("MOEGATE_MODEL", str(other))  # the flag's environment default overrides it too
    assert from_env(policy_path=str(policy), state_dir=tmp_path).model == str(other)


def test_policy_model_errors_are_clear(init_random_checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MOEGATE_MODEL", raising=False)
    monkeypatch.delenv("MOEGATE_POLICY", raising=False)
    policy = tmp_path / "p.yaml"
    policy.write_text(_policy([("big", str(init_random_checkpoint))]))
    assert main(["serve", "--config", str(policy), "--model-name", "small"]) == 2
    assert "does not list the model 'small'" in capsys.readouterr().err

    policy.write_text(_policy([("big", str(tmp_path / "nowhere"))]))
    assert main(["serve", "--config", str(policy)]) == 2
    err = capsys.readouterr().err
    assert "source of model 'big'" in err and "nowhere" in err

    policy.write_text(_policy([("big", None)]))
    with pytest.raises(ModelNotFound, match="has no `source`"):
        from_env(policy_path=str(policy), state_dir=tmp_path)
    policy.write_text(_policy([("big", "builtin:huge")]))
    with pytest.raises(ModelNotFound, match="unknown built-in model 'builtin:huge'"):
        from_env(policy_path=str(policy), state_dir=tmp_path)
    policy.write_text("id: [")
    assert main(["serve", "--config", str(policy)]) == 2
    assert "YAML syntax" in capsys.readouterr().err
