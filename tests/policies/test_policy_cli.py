"""`moegate policy check | schema | hash-key` through the registered argparse subcommands."""

import argparse
import io
import json
from pathlib import Path

import jsonschema
import yaml

from policies import cli, hash_api_key
from policies.loader import _Loader

EXAMPLES = Path(__file__).resolve().parents[2] / "policies" / "examples"


def _run(argv, monkeypatch=None, stdin=""):
    parser = argparse.ArgumentParser(prog="moegate")
    cli.register(parser.add_subparsers(dest="command", required=True))
    if monkeypatch is not None:
        monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    args = parser.parse_args(argv)
    return args.func(args)


def test_check_ok(capsys):
    assert _run(["policy", "check", str(EXAMPLES / "dev.yaml"), str(EXAMPLES / "finance.yaml")]) == 0
    out = capsys.readouterr().out
    assert "'dev'" in out and "'finance-prod'" in out and out.count(": ok: ") == 2


def test_check_bad_names_line_and_field(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text((EXAMPLES / "dev.yaml").read_text().replace("  max_tokens: 4096", "  max_tokns: 4096"))
    assert _run(["policy", "check", str(bad)]) == 1
    err = capsys.readouterr().err
    line = next(i for i, t in enumerate(bad.read_text().splitlines(), 1) if "max_tokns" in t)
    assert f"{bad}:{line}:3: limits.max_tokns: unknown field" in err


def test_schema_validates_examples(tmp_path):
    out = tmp_path / "schema.json"
    assert _run(["policy", "schema", "--out", str(out)]) == 0
    schema = json.loads(out.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    for name in ("dev.yaml", "finance.yaml"):
        jsonschema.validate(yaml.load((EXAMPLES / name).read_text(), Loader=_Loader), schema)
    bad = yaml.load((EXAMPLES / "dev.yaml").read_text(), Loader=_Loader) | {"tenantz": []}
    assert list(jsonschema.Draft202012Validator(schema).iter_errors(bad))  # extra keys are errors in editors too


def test_hash_key(capsys, monkeypatch):
    assert _run(["policy", "hash-key", "abc"]) == 0
    assert capsys.readouterr().out.strip() == hash_api_key("abc")
    assert _run(["policy", "hash-key"], monkeypatch, stdin="from-stdin\n") == 0
    assert capsys.readouterr().out.strip() == hash_api_key("from-stdin")
    assert _run(["policy", "hash-key", "--generate"]) == 0
    key_line, hash_line = capsys.readouterr().out.splitlines()
    assert hash_api_key(key_line.split()[1]) == hash_line.split()[1]


def test_committed_schema_is_current(tmp_path):
    """policies/policy.schema.json (referenced by the examples for editors) matches the model."""
    out = tmp_path / "schema.json"
    _run(["policy", "schema", "--out", str(out)])
    committed = EXAMPLES.parent / "policy.schema.json"
    assert json.loads(committed.read_text()) == json.loads(out.read_text()), (
        "regenerate with `moegate policy schema --out policies/policy.schema.json`")
