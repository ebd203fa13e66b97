"""Kubernetes manifests: schema-valid offline (kubernetes-validate), consistent with each other and the image."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (offline schemas)")

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
BASE = K8S / "base"
OVERLAY = K8S / "cuda"
# Newest schemas bundled with the validator, and the oldest Kubernetes the manifests promise to run on
# (the preStop `sleep` action needs 1.30).
VERSIONS = ("1.37.0", "1.30.0")


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _kustomization(path: Path) -> dict:
    return yaml.safe_load((path / "kustomization.yaml").read_text())


def _manifest_files() -> list[Path]:
    return sorted(p for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml")


def _apply_json6902(doc: dict, ops: list[dict]) -> dict:
    """The `add` / `replace` subset of RFC 6902 that the overlay uses."""
    doc = copy.deepcopy(doc)
    for op in ops:
        keys = [k.replace("~1", "/").replace("~0", "~") for k in op["path"].lstrip("/").split("/")]
        parent = doc
        for key in keys[:-1]:
            parent = parent[int(key)] if isinstance(parent, list) else parent[key]
        last = keys[-1]
        if op["op"] == "replace" and last not in parent:
            raise KeyError(f"replace of missing path {op['path']}")
        if op["op"] not in ("add", "replace"):
            raise ValueError(f"unsupported op {op['op']}")
        parent[last] = op["value"]
    return doc


def _render(path: Path) -> list[dict]:
    """A small kustomize: resources, JSON 6902 patches by kind+name, image tags, metadata labels."""
    k = _kustomization(path)
    docs: list[dict] = []
    for res in k.get("resources", []):
        target = path / res
        docs += _render(target) if target.is_dir() else _docs(target)
    for patch in k.get("patches", []):
        ops = yaml.safe_load(patch["patch"]) if "patch" in patch else yaml.safe_load((path / patch["path"]).read_text())
        t = patch["target"]
        hits = [i for i, d in enumerate(docs) if d["kind"] == t["kind"] and d["metadata"]["name"] == t["name"]]
        assert len(hits) == 1, f"patch target {t} matches {len(hits)} resources"
        docs[hits[0]] = _apply_json6902(docs[hits[0]], ops)
    for image in k.get("images", []):
        for d in docs:
            for c in _pod_spec(d).get("containers", []) if _pod_spec(d) else []:
                if c["image"].split(":")[0] == image["name"]:
                    c["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
    for label in k.get("labels", []):
        for d in docs:
            d["metadata"].setdefault("labels", {}).update(label["pairs"])
    return docs


def _pod_spec(doc: dict) -> dict | None:
    if doc["kind"] in ("Deployment", "StatefulSet"):
        return doc["spec"]["template"]["spec"]
    return None


def _by_kind(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def _validate_all(docs: list[dict], version: str) -> None:
    for d in docs:
        kv.validate(d, version, strict=True)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_file_validates_strictly(version):
    files = _manifest_files()
    assert {f.name for f in files} >= {"deployment.yaml", "service.yaml", "configmap.yaml", "secret.yaml",
                                       "hpa.yaml", "redis.yaml"}
    for f in files:
        docs = _docs(f)
        assert docs, f"{f} is empty"
        _validate_all(docs, version)


@pytest.mark.parametrize("version", VERSIONS)
def test_rendered_base_and_cuda_overlay_validate(version):
    _validate_all(_render(BASE), version)
    _validate_all(_render(OVERLAY), version)


def test_validator_rejects_a_broken_manifest():
    dep = copy.deepcopy(_by_kind(_docs(BASE / "deployment.yaml"), "Deployment")["moegate"])
    dep["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pathh"] = "/health"
    with pytest.raises(kv.ValidationError):
        kv.validate(dep, VERSIONS[0], strict=True)
    dep = copy.deepcopy(_by_kind(_docs(BASE / "deployment.yaml"), "Deployment")["moegate"])
    dep["spec"]["replicas"] = "two"
    with pytest.raises(kv.ValidationError):
        kv.validate(dep, VERSIONS[0], strict=False)


def test_kustomization_lists_every_manifest_but_the_secret_template():
    listed = set(_kustomization(BASE)["resources"])
    assert listed == {f.name for f in _manifest_files()} - {"secret.yaml"}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (for `kubectl kustomize`) not installed")
@pytest.mark.parametrize("path", [BASE, OVERLAY], ids=["base", "cuda"])
def test_real_kustomize_agrees_with_the_test_renderer(path):
    out = subprocess.run(["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    real = [d for d in yaml.safe_load_all(out.stdout) if d]
    _validate_all(real, VERSIONS[0])
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    mine = {key(d): d for d in _render(path)}
    assert {key(d) for d in real} == set(mine)
    for d in real:
        if _pod_spec(d):
            assert _pod_spec(d)["containers"] == _pod_spec(mine[key(d)])["containers"]


def _gateway(docs: list[dict]) -> dict:
    return _by_kind(docs, "Deployment")["moegate"]


def test_gateway_probes_ports_and_security():
    dep = _gateway(_render(BASE))
    spec = dep["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    assert c["args"][:5] == ["serve", "--host", "0.0.0.0", "--port", "8000"]
    assert {"name": "http", "containerPort": 8000, "protocol": "TCP"} in c["ports"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    assert spec["securityContext"]["runAsNonRoot"] is True
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert f"USER {spec['securityContext']['runAsUser']}:" in dockerfile
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert {"/etc/moegate", "/models", "/var/cache/moegate", "/tmp"} <= set(mounts)
    assert mounts["/models"]["readOnly"] and mounts["/etc/moegate"]["readOnly"]
    assert "--config" in c["args"] and c["args"][c["args"].index("--config") + 1].startswith("/etc/moegate/")


def test_references_resolve_to_defined_objects():
    docs = _render(BASE)
    configmaps = _by_kind(docs, "ConfigMap")
    secret = _by_kind(_docs(BASE / "secret.yaml"), "Secret")["moegate-secrets"]
    pvcs = _by_kind(docs, "PersistentVolumeClaim")
    for d in docs:
        spec = _pod_spec(d)
        if not spec:
            continue
        for vol in spec.get("volumes", []):
            if "configMap" in vol:
                assert vol["configMap"]["name"] in configmaps
            if "persistentVolumeClaim" in vol:
                assert vol["persistentVolumeClaim"]["claimName"] in pvcs
        for c in spec["containers"]:
            for src in c.get("envFrom", []):
                assert src["configMapRef"]["name"] in configmaps
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["name"] == "moegate-secrets" and ref["key"] in secret["stringData"]
    # the policy ConfigMap key is what --config points at
    args = _gateway(docs)["spec"]["template"]["spec"]["containers"][0]["args"]
    assert Path(args[args.index("--config") + 1]).name in configmaps["moegate-policy"]["data"]


def test_services_hpa_and_pdb_select_the_gateway_pods():
    docs = _render(BASE)
    pod_labels = _gateway(docs)["spec"]["template"]["metadata"]["labels"]
    services = _by_kind(docs, "Service")
    for name in ("moegate", "moegate-replicas"):
        assert services[name]["spec"]["selector"].items() <= pod_labels.items()
    assert services["moegate-replicas"]["spec"]["clusterIP"] == "None"
    hpa = _by_kind(docs, "HorizontalPodAutoscaler")["moegate"]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "moegate"}
    assert 1 <= hpa["minReplicas"] <= hpa["maxReplicas"]
    pdb = _by_kind(docs, "PodDisruptionBudget")["moegate"]["spec"]
    assert pdb["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pdb["minAvailable"] < hpa["minReplicas"]


def test_redis_is_the_shared_store_behind_a_password():
    docs = _render(BASE)
    env = {e["name"]: e for e in _gateway(docs)["spec"]["template"]["spec"]["containers"][0]["env"]}
    url = env["REDIS_URL"]["value"]
    m = re.fullmatch(r"redis://:\$\(REDIS_PASSWORD\)@([\w-]+):(\d+)/\d+", url)
    assert m, url
    names = [e["name"] for e in _gateway(docs)["spec"]["template"]["spec"]["containers"][0]["env"]]
    assert names.index("REDIS_PASSWORD") < names.index("REDIS_URL")  # $(VAR) needs an earlier definition
    svc = _by_kind(docs, "Service")[m.group(1)]
    assert int(m.group(2)) in [p["port"] for p in svc["spec"]["ports"]]
    redis = _by_kind(docs, "StatefulSet")["moegate-redis"]
    assert svc["spec"]["selector"].items() <= redis["spec"]["template"]["metadata"]["labels"].items()
    args = redis["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    netpol = _by_kind(docs, "NetworkPolicy")["moegate-redis"]["spec"]
    allowed = netpol["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    assert allowed.items() <= _gateway(docs)["spec"]["template"]["metadata"]["labels"].items()


def test_no_secret_value_is_committed():
    secret = _by_kind(_docs(BASE / "secret.yaml"), "Secret")["moegate-secrets"]
    assert "data" not in secret and all(v == "" for v in secret["stringData"].values())
    for f in [*_manifest_files(), *OVERLAY.glob("*.yaml")]:
        text = f.read_text()
        assert not re.search(r"sk-[A-Za-z0-9_-]{16,}", text), f
        assert not re.search(r"(?i)password\s*[:=]\s*['\"]?[A-Za-z0-9]{6,}", text), f
    policy = yaml.safe_load(_by_kind(_docs(BASE / "configmap.yaml"), "ConfigMap")["moegate-policy"]["data"]
                            ["policy.yaml"])
    hashes = [k["hash"] for t in policy["tenants"] for k in t["api_keys"]]
    assert hashes and all(re.fullmatch(r"sha256:[0-9a-f]{64}", h) for h in hashes)


def test_policy_configmap_is_a_valid_policy():
    loader = pytest.importorskip("policies.loader", reason="policy package not in this checkout")
    cm = _by_kind(_docs(BASE / "configmap.yaml"), "ConfigMap")["moegate-policy"]
    policy = loader.parse_policy(cm["data"]["policy.yaml"], "configmap:moegate-policy")
    assert policy.tenants


def test_cuda_overlay_requests_a_gpu_and_the_cuda_image():
    docs = _render(OVERLAY)
    c = _gateway(docs)["spec"]["template"]["spec"]["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert c["image"].endswith("-cuda")
    assert _by_kind(docs, "ConfigMap")["moegate-config"]["data"]["MOEGATE_DEVICE"] == "cuda"
    base = _gateway(_render(BASE))["spec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in base["resources"]["limits"] and base["image"].endswith("-cpu")
