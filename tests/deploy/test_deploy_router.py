"""Prefix-affinity router: the Envoy config decodes into Envoy's v3 protos and hashes tenant + prefix."""

from __future__ import annotations

import importlib
import warnings
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
ROUTER = ROOT / "deploy" / "k8s" / "base" / "affinity-router.yaml"
SERVICES = ROOT / "deploy" / "k8s" / "base" / "service.yaml"
# Typed configs (google.protobuf.Any) the router uses: their modules register the message types.
_EXTENSIONS = [
    "envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3",
    "envoy_data_plane.envoy.extensions.filters.http.router.v3",
    "envoy_data_plane.envoy.extensions.filters.http.health_check.v3",
]


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _envoy_config() -> dict:
    cm = next(d for d in _docs(ROUTER) if d["kind"] == "ConfigMap")
    return yaml.safe_load(cm["data"]["envoy.yaml"])


@pytest.fixture(scope="module")
def bootstrap_cls():
    with warnings.catch_warnings():  # the generated code trips pydantic deprecation warnings on import
        warnings.simplefilter("ignore", DeprecationWarning)
        pytest.importorskip("envoy_data_plane", reason="pip install envoy-data-plane (Envoy v3 API messages)")
        for name in _EXTENSIONS:
            importlib.import_module(name)
        from envoy_data_plane.envoy.config.bootstrap.v3 import Bootstrap

    return Bootstrap


def test_envoy_config_decodes_into_envoy_v3_messages(bootstrap_cls):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # no field Envoy has deprecated
        boot = bootstrap_cls.from_dict(_envoy_config())  # unknown fields / enum values raise
    (cluster,) = boot.static_resources.clusters
    assert cluster.lb_policy.name in ("RING_HASH", "MAGLEV")
    assert cluster.common_lb_config.consistent_hashing_lb_config.hash_balance_factor == 150
    hcm = boot.static_resources.listeners[0].filter_chains[0].filters[0].typed_config.unpack()
    route = hcm.route_config.virtual_hosts[0].routes[0].route
    assert [h.header.header_name for h in route.hash_policy] == ["authorization", "x-moegate-affinity"]
    assert [f.name for f in hcm.http_filters][-1] == "envoy.filters.http.router"  # router filter last


@pytest.mark.parametrize("path, key, value", [
    (("static_resources", "clusters", 0), "lb_polcy", "RING_HASH"),
    (("static_resources", "clusters", 0), "lb_policy", "RING_HASHH"),
    (("static_resources", "listeners", 0, "filter_chains", 0, "filters", 0, "typed_config", "route_config",
      "virtual_hosts", 0, "routes", 0, "route"), "hash_polcy", []),
])
def test_decoder_rejects_typos(bootstrap_cls, path, key, value):
    cfg = _envoy_config()
    node = cfg
    for p in path:
        node = node[p]
    node[key] = value
    with pytest.raises((KeyError, ValueError)):
        bootstrap_cls.from_dict(cfg)


def test_router_hashes_over_the_headless_replicas():
    envoy = _envoy_config()
    services = {d["metadata"]["name"]: d for d in _docs(SERVICES)}
    (cluster,) = envoy["static_resources"]["clusters"]
    assert cluster["type"] == "STRICT_DNS"  # one host per pod IP of the headless service
    addr = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]
    headless = services[addr["address"]]
    assert headless["spec"]["clusterIP"] == "None"
    assert addr["port_value"] in [p["port"] for p in headless["spec"]["ports"]]
    assert cluster["health_checks"][0]["http_health_check"]["path"] == "/health"
    hcm = envoy["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    route = hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    assert route["cluster"] == cluster["name"]
    listen_port = envoy["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"]
    docs = {(d["kind"], d["metadata"]["name"]): d for d in _docs(ROUTER)}
    router = docs[("Deployment", "moegate-router")]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "http", "containerPort": listen_port} in router["ports"]
    mount = router["volumeMounts"][0]["mountPath"]
    assert router["args"][router["args"].index("--config-path") + 1] == f"{mount}/envoy.yaml"
    svc = docs[("Service", "moegate-router")]["spec"]
    pod_labels = docs[("Deployment", "moegate-router")]["spec"]["template"]["metadata"]["labels"]
    assert svc["selector"].items() <= pod_labels.items()
    health = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.health_check"][0]
    assert health["typed_config"]["headers"][0]["string_match"]["exact"] == router["readinessProbe"]["httpGet"]["path"]
