"""The ad-hoc families: orders against a response_format schema, quote calls to a client's own tools, SQL over a
client's own tables; answers valid for what the client sent, values copied from the user turn."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from evals.demo import adhoc
from evals.demo.chat_format import render
from evals.demo.corpus import FAMILIES, adhoc_heldout_tasks, conversation, to_task
from gateway.structured.sql_schema import DatabaseSchema, SQLPolicy
from gateway.structured.validate import validate_sql

N = 120


def _family(name: str) -> list:
    return [conversation("train", i, family=name) for i in range(N)]


def test_adhoc_families_stay_out_of_the_default_mixture():
    assert {name: weight for name, weight, _ in FAMILIES if name.startswith("adhoc_")} == \
        {"adhoc_order": 0.0, "adhoc_quote": 0.0, "adhoc_sql": 0.0}


def test_adhoc_orders_answer_the_schema_with_the_user_turns_values_and_keep_the_schema_out_of_the_prompt():
    keys = set()
    for conv in _family("adhoc_order"):
        text = conv.messages[conv.answer_index]["content"]
        answer = json.loads(text)
        assert text == json.dumps(answer, separators=(",", ":"))
        jsonschema.validate(answer, conv.schema)
        assert list(answer) == [k for k in conv.schema["properties"] if k in answer]  # the grammar's key order
        user = conv.messages[conv.answer_index - 1]["content"]
        for value in answer.values():
            spelled = f"{value:.2f}" if isinstance(value, float) else str(value)
            assert spelled in user or spelled.capitalize() in user
        assert not any("properties" in m["content"] for m in conv.messages[:conv.answer_index])
        keys |= set(answer)
    assert {"symbol", "ticker", "qty", "quantity", "shares", "side"} <= keys


def test_quantities_spread_over_small_round_and_repeated_digit_sizes():
    rng = random.Random(0)
    qty = [adhoc.quantity(rng) for _ in range(2000)]
    assert min(qty) == 1 and all(q >= 1 for q in qty)
    assert sum(q <= 20 for q in qty) > 500
    assert {10, 11, 100, 1000} <= set(qty)
    assert sum(len(set(str(q))) < len(str(q)) for q in qty) > 400  # a digit repeats (11, 300, 4444)


def test_adhoc_quote_calls_name_the_clients_quote_tool_with_the_users_ticker():
    names = set()
    for conv in _family("adhoc_quote"):
        declared = {t["function"]["name"]: t["function"]["parameters"] for t in conv.tools}
        call = conv.messages[conv.answer_index]["tool_calls"][0]["function"]
        assert call["name"] in declared and call["name"] in adhoc.NAMES.quote_tools
        jsonschema.validate(call["arguments"], declared[call["name"]])
        (symbol,) = call["arguments"].values()
        assert symbol in conv.messages[conv.answer_index - 1]["content"]
        names.add(call["name"])
    assert len(names) >= 4


@pytest.mark.parametrize("dialect", ["sqlite", "postgres"])
def test_adhoc_sql_answers_pass_the_gateways_validator_for_their_tables_and_return_rows(dialect):
    non_empty = 0
    for conv in _family("adhoc_sql"):
        task = to_task(conv)
        assert task.kind == "sql" and task.tables == conv.tables
        validate_sql(task.expected["sql"], DatabaseSchema.from_mapping(conv.tables), SQLPolicy(dialect=dialect))
        non_empty += bool(task.expected["rows"]) and task.expected["rows"][0] != [None]
    assert non_empty >= 0.8 * N


def test_adhoc_heldout_tasks_use_names_no_training_chat_uses_and_skip_excluded_chats():
    tasks = adhoc_heldout_tasks(60)
    assert {t.kind for t in tasks} == {"json", "tool_call", "sql"}
    novel = {*adhoc.HELDOUT_NAMES.symbol_keys, *adhoc.HELDOUT_NAMES.qty_keys} - \
        {*adhoc.NAMES.symbol_keys, *adhoc.NAMES.qty_keys}
    assert any(set(t.schema["properties"]) & novel for t in tasks if t.kind == "json")
    assert all(t.expected["name"] in adhoc.HELDOUT_NAMES.quote_tools for t in tasks if t.kind == "tool_call")
    assert all(set(t.tables) <= set(adhoc.HELDOUT_NAMES.price_tables) | {"trades"} for t in tasks if t.kind == "sql")
    assert adhoc_heldout_tasks(10) == tasks[:10]
    first = render(tasks[0].messages + [{"role": "assistant", "content": json.dumps(tasks[0].expected,
                                                                                   separators=(",", ":"))}])
    assert adhoc_heldout_tasks(3, exclude=frozenset({first})) == tasks[1:4]
