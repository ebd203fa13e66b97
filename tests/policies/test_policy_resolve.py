"""Authentication and per-request resolution against the example policies."""

from pathlib import Path

import pytest

from policies import PolicyDenied, hash_api_key, load_policy

EXAMPLES = Path(__file__).resolve().parents[2] / "policies" / "examples"


@pytest.fixture(scope="module")
def fin():
    return load_policy(EXAMPLES / "finance.yaml")


def test_hash_format():
    assert hash_api_key("sk-dev-local") == (
        "sha256:c2ed58e590dac70908894812c7d38a9fbca1fc385edcc8fcc7d9cb7d967701b7")


def test_authenticate(fin):
    assert fin.authenticate("sk-fin-desk-a-EXAMPLE-ONLY").id == "desk-a"
    assert fin.authenticate("sk-fin-risk-EXAMPLE-ONLY").id == "risk"
    assert fin.authenticate("sk-fin-risk-EXAMPLE-ONLY ") is None
    assert fin.authenticate("") is None
    # the stored hash itself is not a key
    assert fin.authenticate(fin.tenants[0].api_keys[0].hash) is None


def test_resolve_merges_limits_policy_route_tenant(fin):
    r = fin.resolve("risk", "/v1/completions", "moegate-demo")
    assert r.limits.max_tokens == 512  # route override
    assert r.limits.concurrency == 8 and r.limits.tokens_per_min == 200000  # tenant override
    assert r.limits.requests_per_min == 120 and r.limits.tokens_per_day == 5000000  # policy default
    assert r.execution_when == {"always"} and r.is_execution([])
    r2 = fin.resolve("risk", "/v1/chat/completions", "qwen3-moe")
    assert r2.limits.max_tokens == 2048 and not r2.is_execution(["stream"]) and r2.is_execution(["sql"])


def test_resolve_modes_precision_and_deferral(fin):
    r = fin.resolve("desk-a", "/v1/chat/completions", "qwen3-moe")
    assert r.precision == {"exploration": "fast", "execution": "formatting-bf16"}
    assert r.precision_profiles["execution"].formatting_layers == 4
    assert r.deferral_depth == {"exploration": "auto", "execution": 0}
    assert r.segment_mode("sql_fence") == "execution" and r.segment_mode("prose") == "exploration"
    assert r.policy_id == "finance-prod" and r.policy_digest == fin.digest
    assert r.on_unavailable == "fail_closed" and r.audit_level == "full"


def test_tools_and_sql(fin):
    r = fin.resolve("desk-a", "/v1/chat/completions", "qwen3-moe")
    r.check_tools(["get_quote", "run_sql"])
    with pytest.raises(PolicyDenied, match="compute_var") as info:
        r.check_tools(["get_quote", "compute_var"])
    assert info.value.reason == "tool"
    assert r.sql_rules("marketdata").allowed_tables == ["prices", "instruments", "fx_rates"]
    with pytest.raises(PolicyDenied, match="ledger"):
        r.sql_rules("ledger")
    research = fin.resolve("research", "/v1/chat/completions", "qwen3-moe")
    assert not research.tool_allowed("get_quote") and research.audit_level == "metadata"
    assert research.limits.requests_per_min == 30


@pytest.mark.parametrize(
    ("tenant", "route", "model", "reason"),
    [
        ("desk-a", "/v1/completions", "moegate-demo", "route"),  # tenant limited to chat
        ("desk-a", "/v1/chat/completions", "moegate-demo", "model"),  # tenant limited to qwen3-moe
        ("risk", "/v1/completions", "qwen3-moe", "model"),  # route serves only the demo model
        ("risk", "/v1/embeddings", "qwen3-moe", "route"),  # unknown route
        ("nobody", "/v1/chat/completions", "qwen3-moe", "tenant"),
    ],
)
def test_resolve_denials(fin, tenant, route, model, reason):
    with pytest.raises(PolicyDenied) as info:
        fin.resolve(tenant, route, model)
    assert info.value.reason == reason


def test_redaction(fin):
    r = fin.resolve("risk", "/v1/chat/completions", "qwen3-moe")
    out = r.redact("pay DE44500105175407324931 from card 4111 1111 1111 1111 using sk-abcdefghij now")
    assert out == "pay [IBAN] from card [ACCOUNT] using [KEY] now"


def test_digest_changes_with_content(fin):
    dev = load_policy(EXAMPLES / "dev.yaml")
    assert dev.digest != fin.digest
    assert load_policy(EXAMPLES / "finance.yaml").digest == fin.digest
