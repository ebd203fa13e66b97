"""JSON Schema constraints over a trained BPE vocab: random-logit outputs always validate."""

from __future__ import annotations

import json
import re

import pytest
import torch

from evals.structured.driver import decode, random_logits
from gateway.structured.build import build_constraint, json_schema_spec
from gateway.structured.cache import ConstraintCache
from gateway.structured.closing import shortest_completion
from gateway.structured.validate import validate_json

ORDER = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{4}$"},
        "symbol": {"type": "string", "minLength": 1, "maxLength": 5},
        "side": {"enum": ["buy", "sell"]},
        "quantity": {"type": "integer", "minimum": 1, "maximum": 10000},
        "limit_price": {"type": ["number", "null"], "exclusiveMinimum": 0},
        "time_in_force": {"type": "string", "enum": ["day", "gtc", "ioc"]},
    },
    "required": ["order_id", "symbol", "side", "quantity"],
    "additionalProperties": False,
}
POSITIONS = {
    "type": "object",
    "properties": {
        "account": {"type": "string", "maxLength": 12},
        "as_of": {"type": "string", "format": "date"},
        "positions": {
            "type": "array", "minItems": 1, "maxItems": 4,
            "items": {
                "type": "object",
                "properties": {
                    "symbol": {"type": "string", "maxLength": 6},
                    "qty": {"type": "integer", "minimum": -1000000, "maximum": 1000000},
                    "avg_cost": {"type": "number", "minimum": 0},
                    "currency": {"const": "USD"},
                },
                "required": ["symbol", "qty", "avg_cost", "currency"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["account", "as_of", "positions"],
    "additionalProperties": False,
}
RISK_REPORT = {
    "$defs": {"limit": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 16}, "utilisation": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["name", "utilisation"], "additionalProperties": False}},
    "type": "object",
    "properties": {
        "portfolio": {"type": "string", "maxLength": 10},
        "var_95": {"type": "number", "minimum": 0},
        "stress": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {
            "scenario": {"enum": ["rates_up", "equity_crash"]}, "pnl": {"type": "number"}},
            "required": ["scenario", "pnl"], "additionalProperties": False}]},
        "limits": {"type": "array", "items": {"$ref": "#/$defs/limit"}, "maxItems": 3},
        "approved": {"type": "boolean"},
    },
    "required": ["portfolio", "var_95", "limits", "approved"],
    "additionalProperties": False,
}
FINANCE = {"order": ORDER, "positions": POSITIONS, "risk_report": RISK_REPORT}


@pytest.mark.parametrize("name", sorted(FINANCE))
def test_random_model_outputs_validate(name, tokinfo):
    cache = ConstraintCache()
    spec = json_schema_spec(FINANCE[name])
    padded_vocab = tokinfo.vocab_size + 61  # lm_head rows past the tokenizer, as in real checkpoints
    for seed in range(6):
        c = build_constraint(spec, tokinfo, max_tokens=256, cache=cache)
        out = decode(c, random_logits(padded_vocab, seed), max_tokens=256)
        assert out.finished, (name, seed, tokinfo.decode(out.ids))
        assert all(t < tokinfo.vocab_size for t in out.ids)
        body = tokinfo.decode(out.ids[:-1])
        validate_json(body, FINANCE[name])  # raises on any schema violation
        outside_strings = re.sub(r'"(\\.|[^"\\])*"', "", body)
        assert not re.search(r"\s", outside_strings), f"free whitespace in {body!r}"
    assert cache.misses == 1 and cache.hits == 5


def test_eos_only_when_accepting_and_padding_never_allowed(tokinfo):
    c = build_constraint(json_schema_spec({"type": "object", "properties": {"a": {"type": "integer"}},
                                           "required": ["a"], "additionalProperties": False}), tokinfo)
    logits = torch.zeros(tokinfo.vocab_size + 40)
    c([], logits)
    allowed = torch.isfinite(logits).nonzero().flatten().tolist()
    assert allowed and all(t < tokinfo.vocab_size for t in allowed)
    assert not set(allowed) & set(tokinfo.eos_ids)
    ids = tokinfo.encode('{"a":7}')
    c.advance(ids)
    assert c.is_accepting() and c.is_terminated()
    logits = torch.zeros(tokinfo.vocab_size + 40)
    c(ids, logits)
    assert set(torch.isfinite(logits).nonzero().flatten().tolist()) == set(tokinfo.eos_ids)


def test_whitespace_is_bounded_in_free_whitespace_grammars(tokinfo):
    from gateway.structured.base import ConstraintKind, ConstraintSpec

    spec = ConstraintSpec(ConstraintKind.GRAMMAR, 'start: "a" WS "b"\nWS: /[ ]+/\n')
    c = build_constraint(spec, tokinfo, cache=ConstraintCache())
    space = tokinfo.encode(" ")
    assert len(space) == 1
    ids = tokinfo.encode("a")
    for _ in range(c.max_whitespace_run):
        ids = ids + space
    logits = torch.zeros(tokinfo.vocab_size)
    c(ids, logits)
    assert logits[space[0]] == float("-inf"), "whitespace run past the bound must be masked"
    assert torch.isfinite(logits[tokinfo.encode("b")[0]])


def _decodes_close_in_budget(tokinfo, schema, budget: int, seeds: int) -> None:
    """Random-logit decodes under a `budget`-token limit: each finishes inside it, with an output the schema's
    validation accepts."""
    spec = json_schema_spec(schema)
    for seed in range(seeds):
        c = build_constraint(spec, tokinfo, max_tokens=budget, cache=ConstraintCache())
        out = decode(c, random_logits(tokinfo.vocab_size, seed), max_tokens=budget)
        assert out.finished and len(out.ids) <= budget
        validate_json(tokinfo.decode(out.ids[:-1]), schema)


def test_closing_window_finishes_inside_budget(tokinfo):
    _decodes_close_in_budget(tokinfo, {"type": "object", "properties": {"note": {"type": "string"}},
                                       "required": ["note"], "additionalProperties": False}, 40, 4)


@pytest.mark.parametrize("pattern", [
    "^all|tags$",  # JSON Schema patterns search: after free text only the `tags$` branch still fits
    "[a-z0-9_-]{100}",  # a counted repeat longer than any single-byte search would walk
    r"\\d{4}-\\d{2}-\\d{2}T\\d{2}",
])
def test_unanchored_patterns_close_inside_budget(pattern, tokinfo):
    schema = {"type": "object", "properties": {"v": {"type": "string", "pattern": pattern}}, "required": ["v"],
              "additionalProperties": False}
    spec = json_schema_spec(schema)
    for seed in range(3):
        c = build_constraint(spec, tokinfo, max_tokens=220, cache=ConstraintCache())
        out = decode(c, random_logits(tokinfo.vocab_size, seed), max_tokens=220)
        assert out.finished, (pattern, seed, tokinfo.decode(out.ids)[-80:])
        validate_json(tokinfo.decode(out.ids[:-1]), schema)


def test_completion_found_inside_a_multibyte_character(tokinfo):
    """Half a UTF-8 character in a string: only continuation bytes fit (more of them than the search
    samples per state), and a completion must still be found."""
    c = build_constraint(json_schema_spec({"type": "string"}), tokinfo, cache=ConstraintCache())
    lead = tokinfo.token_bytes.index(b"\xe2")
    assert all(c.consume(t) for t in [*tokinfo.encode('"'), lead])
    path = shortest_completion(c.matcher.llg, tokinfo, 16)
    assert path is not None and all(c.consume(t) for t in path) and c.is_accepting()
    json.loads(tokinfo.decode(tokinfo.encode('"') + [lead] + path))


def test_completion_thousands_of_tokens_deep(tokinfo):
    """minItems 1500: the shortest output is thousands of tokens; the search walks it without recursion."""
    c = build_constraint(json_schema_spec({"type": "array", "items": {"type": "integer"}, "minItems": 1500}),
                         tokinfo, cache=ConstraintCache())
    path = shortest_completion(c.matcher.llg, tokinfo, 8000)
    assert path is not None and len(path) > 1500
    assert all(c.consume(t) for t in path) and c.is_accepting()
    assert len(json.loads(tokinfo.decode(path))) == 1500


@pytest.mark.parametrize("schema, good, bad", [
    ({"type": "array", "items": [{"type": "integer"}], "additionalItems": False}, ["[1]", "[]"], ['["a"]', "[1,2]"]),
    ({"type": "object", "minProperties": 2}, ['{"a":1,"b":2}'], ['{"a":1}']),
    ({"type": "number", "minimum": 0, "exclusiveMinimum": True}, ["1", "0.5"], ["0", "-1"]),  # draft-4 form
    ({"type": "integer", "maximum": 10}, ["10"], ["11"]),
    ({"type": "string", "format": "email"}, ['"a@b.co"'], ['"x"']),
])
def test_keywords_are_enforced_not_dropped(schema, good, bad, tokinfo):
    cache = ConstraintCache()
    for text, expect in [(t, True) for t in good] + [(t, False) for t in bad]:
        c = build_constraint(json_schema_spec(schema), tokinfo, cache=cache)
        ok = all(c.consume(i) for i in tokinfo.encode(text)) and c.is_accepting()
        assert ok is expect, (schema, text)



def test_completion_paths_shared_by_requests(tokinfo, monkeypatch):
    """A completion path is searched once per compiled constraint, budget and output so far: a request that writes the
    same ids as an earlier one searches nothing and decodes the same ids; with only the start states' paths kept
    (drop_shared_paths), every search but the start's runs again."""
    import gateway.structured.closing as closing_mod
    import gateway.structured.closing_planner as planner_mod

    calls = []
    real = planner_mod.shortest_completion
    monkeypatch.setattr(planner_mod, "shortest_completion", lambda *a, **kw: calls.append(a[2]) or real(*a, **kw))
    monkeypatch.setattr(closing_mod, "_PATHS", {})
    cache, spec, outs, searches = ConstraintCache(), json_schema_spec(ORDER), [], []
    for run in ("unshared", 0, 1, 2):
        if run == 2:
            closing_mod.drop_shared_paths()
        with monkeypatch.context() as m:
            if run == "unshared":  # every search runs, nothing is kept
                m.setattr(planner_mod, "shared_path", lambda key, search: (search(), True))
            calls.clear()
            c = build_constraint(spec, tokinfo, max_tokens=60, cache=cache)
            outs.append(decode(c, random_logits(tokinfo.vocab_size, 9), max_tokens=60).ids)  # (a seed whose output
            searches.append(list(calls))  # leaves its last path: searched again)
            assert c.plan_searches == len(calls)
    assert outs[0] == outs[1] == outs[2] == outs[3]
    unshared, searches = searches[0], searches[1:]
    assert unshared == searches[0]
    assert searches[0][0] == 59 and len(searches[0]) > 1  # the start search (depth 59), then the output's own
    assert searches[1] == [] and searches[2] == searches[0][1:]
    assert list(closing_mod._PATHS)[0] == (c.compiled, 59, closing_mod.START)


@pytest.mark.parametrize("schema", [ORDER, POSITIONS])
def test_closing_planner_answers_are_completions_inside_the_budget(schema, tokinfo, monkeypatch):
    """Every path the closing planner answers a check with (a suffix of the last path found, or a search's) takes a
    copy of the matcher to an accepting state the guard keeps, in no more ids than the budget leaves; the suffixes
    answer most checks; the outputs close inside the budget and validate."""
    from gateway.structured.closing_planner import ClosingPlanner

    real, answered_by_suffix = ClosingPlanner.completion_path, []

    def checked(self, llg, guard, max_depth, closing):
        reuses = self.reuses
        path = real(self, llg, guard, max_depth, closing)
        if path is not None:
            copy = llg.deep_copy()
            assert len(path) <= max_depth and copy.try_consume_tokens(path) == len(path) and copy.is_accepting()
            assert guard is None or guard.allows(path, True)
        answered_by_suffix.append(self.reuses > reuses)
        return path

    monkeypatch.setattr(ClosingPlanner, "completion_path", checked)
    for seed in range(4):
        c = build_constraint(json_schema_spec(schema), tokinfo, max_tokens=64, cache=ConstraintCache())
        out = decode(c, random_logits(tokinfo.vocab_size, seed), max_tokens=64)
        assert out.finished and len(out.ids) <= 64
        validate_json(tokinfo.decode(out.ids[:-1]), schema)
    assert sum(answered_by_suffix) > len(answered_by_suffix) // 2


@pytest.mark.parametrize("schema", [
    # the shortest closing of the string ("") is what validation refuses
    {"type": "object", "properties": {"note": {"type": "string", "not": {"const": ""}}}, "required": ["note"],
     "additionalProperties": False},
    # an overlapping oneOf: the grammar takes either branch, exactly one must match
    {"type": "object", "properties": {"v": {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]}},
     "required": ["v"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 3}, "minItems": 3, "uniqueItems": True},
])
def test_closing_paths_pass_the_validation_only_keywords(schema, tokinfo):
    """A completion the planner forces must be an output validation accepts, not one the grammar's superset
    admits: else the gateway's retry closes the same way and the request ends in a 400."""
    _decodes_close_in_budget(tokinfo, schema, 16, 6)
