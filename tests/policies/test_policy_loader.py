"""Policy YAML loading: the examples are valid, and every invalid file is rejected naming field and line."""

from pathlib import Path

import pytest

from policies.loader import PolicyError, load_policy, parse_policy

EXAMPLES = Path(__file__).resolve().parents[2] / "policies" / "examples"
FINANCE = (EXAMPLES / "finance.yaml").read_text()


def _line_of(text: str, needle: str) -> int:
    """1-based line of the last line containing `needle`."""
    return max(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def _reject(text: str) -> PolicyError:
    with pytest.raises(PolicyError) as info:
        parse_policy(text, "p.yaml")
    return info.value


@pytest.mark.parametrize("name", ["dev.yaml", "finance.yaml"])
def test_examples_load(name):
    policy = load_policy(EXAMPLES / name)
    assert policy.tenants and policy.models and policy.routes
    assert policy.digest.startswith("sha256:") and len(policy.digest) == 71


def test_examples_are_what_they_claim():
    dev, fin = load_policy(EXAMPLES / "dev.yaml"), load_policy(EXAMPLES / "finance.yaml")
    assert dev.stores.on_unavailable == "fail_open" and fin.stores.on_unavailable == "fail_closed"
    assert dev.tenants[0].allowed_tools == ["*"]
    assert all("*" not in t.allowed_tools for t in fin.tenants)
    assert all(db.read_only and db.allowed_tables and db.row_limit for db in fin.databases.values())
    assert fin.audit.level == "full" and fin.audit.fsync == "always" and fin.audit.redact


@pytest.mark.parametrize(
    ("old", "new", "field", "needle", "words"),
    [
        ("concurrency: 8", "concurrency: -8", "tenants[1].limits.concurrency", "concurrency: -8", "greater than 0"),
        ("    read_only: true\n    allowed_tables: [prices", "    read_onyl: true\n    allowed_tables: [prices",
         "databases.marketdata.read_onyl", "read_onyl", "unknown field"),
        ("databases: [marketdata, ledger]", "databases: [marketdata, ledgr]", "tenants[1].databases[1]",
         "ledgr", "unknown database 'ledgr'"),
        ("deferral_depth: 0,", "deferral_depth: 1,", "modes.execution.deferral_depth", "deferral_depth: 1,",
         "must not defer"),
        ("dialect: snowflake", "dialect: snowflak", "databases.ledger.dialect", "snowflak", "unknown SQL dialect"),
        ("id: risk", "id: desk-a", "tenants[1].id", "id: desk-a", "duplicate id"),
        ("execution: {precision: formatting-bf16", "execution: {precision: formatting-bf17",
         "modes.execution.precision", "formatting-bf17", "unknown precision profile"),
        ("    models: [qwen3-moe]\n    routes: [/v1/chat/completions]\n    allowed_tools: [get_quote",
         "    models: [qwen3]\n    routes: [/v1/chat/completions]\n    allowed_tools: [get_quote",
         "tenants[0].models[0]", "models: [qwen3]", "unknown model 'qwen3'"),
        ("  level: full", "  level: everything", "audit.level", "level: everything", "'off', 'metadata' or 'full'"),
        ("'[IBAN]'", "'[IBAN]'\n    - pattern: '(unclosed'", "audit.redact[1].pattern", "(unclosed", "regular expression"),
        ("hash: sha256:b7b2", "hash: md5:b7b2", "tenants[1].api_keys[0].hash", "md5:b7b2", "pattern"),
        ("  tokens_per_day: 5000000", "  tokens_per_dya: 5000000", "limits.tokens_per_dya", "tokens_per_dya",
         "unknown field"),
        ("  tokens_per_day: 5000000", "  tokens_per_day: 5000000\ndecoding:\n  jump_forward_tokens: -1",
         "decoding.jump_forward_tokens", "jump_forward_tokens: -1", "greater than or equal to 0"),
    ],
)
def test_invalid_field_is_named_with_its_line(old, new, field, needle, words):
    text = FINANCE.replace(old, new, 1)
    assert text != FINANCE
    err = _reject(text)
    issue = next((i for i in err.issues if i.field == field), None)
    assert issue is not None, [i.field for i in err.issues]
    assert words in issue.message
    assert issue.line == _line_of(text, needle)
    assert f"p.yaml:{issue.line}:" in str(err) and field in str(err)


def test_bad_mapping_key_points_at_the_key():
    text = FINANCE.replace("segments: {json_fence: execution", "segments: {json_fencee: execution", 1)
    issue = _reject(text).issues[0]
    assert issue.field == "modes.segments.json_fencee" and "'json_fence', 'sql_fence' or 'tool_call'" in issue.message
    line = text.splitlines()[issue.line - 1]
    assert line[issue.column - 1:].startswith("json_fencee")


def test_missing_required_field_points_at_parent():
    text = FINANCE.replace("  exploration: {precision: fast, deferral_depth: auto}   # defers on a GPU, not on a CPU-only machine\n", "", 1)
    err = _reject(text)
    issue = next(i for i in err.issues if i.field == "modes.exploration")
    assert "required" in issue.message.lower()
    assert issue.line == _line_of(text, "  execution_when: [json_schema")


def test_duplicate_yaml_key_rejected():
    text = FINANCE.replace("  concurrency: 4\n", "  concurrency: 4\n  concurrency: 40\n", 1)
    err = _reject(text)
    assert err.issues[0].field == "limits.concurrency" and err.issues[0].message == "duplicate key"
    assert err.issues[0].line == _line_of(text, "concurrency: 40")


def test_yaml_syntax_error_has_position():
    err = _reject("id: x\nmodels: [a,\n")
    assert err.issues[0].message.startswith("YAML syntax") and err.issues[0].line is not None


def test_empty_and_non_mapping_rejected():
    assert "empty" in str(_reject(""))
    assert "mapping" in str(_reject("- 1\n- 2\n"))


def test_off_and_no_stay_strings():
    policy = parse_policy(FINANCE.replace("  level: full", "  level: off", 1))
    assert policy.audit.level == "off"


def test_unreadable_file(tmp_path):
    with pytest.raises(PolicyError, match="cannot read"):
        load_policy(tmp_path / "missing.yaml")
