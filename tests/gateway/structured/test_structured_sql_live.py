"""SQL liveness under the token budget: every prefix the constraint admits closes inside max_tokens. The budget rule
(sql_budget.py) refuses invented names early, so a random model writes calls, strings and CTEs instead; their
closing texts (sql_closing.py) and the budget's word check must not leave such a prefix without a way out."""

from __future__ import annotations

import json

import pytest
import torch

from gateway.structured.cache import ConstraintCache
from gateway.structured.closing import shortest_completion
from gateway.structured.closing_planner import _hints
from gateway.structured.sql_closing import closing_text
from gateway.structured.sql_grammar import sql_grammar, sql_spec
from gateway.structured.sql_guard import SQLScopeGuard
from gateway.structured.sql_schema import DatabaseSchema, SQLPolicy
from gateway.structured.sql_scope import WORDS_COMMENT, SQLScope, SQLWords, _Veto
from gateway.structured.sql_validate import check_sql

DB = DatabaseSchema.from_mapping({"trades": ["id", "account_id", "symbol", "qty"], "accounts": ["id", "name"]})


def _scope(dialect: str, text: str) -> SQLScope:
    g = sql_grammar(DB, SQLPolicy(dialect=dialect))
    at = g.find(WORDS_COMMENT)
    words = SQLWords.from_json(json.loads(g[at + len(WORDS_COMMENT):].split("\n", 1)[0]))
    s = SQLScope({t: frozenset(c) for t, c in DB.tables.items()}, False, words)
    s.feed(text)
    return s


@pytest.mark.parametrize("dialect", ["sqlite", "postgres"])
@pytest.mark.parametrize("prefix", [
    "SELECT concat(replace('@",  # a string inside calls: its quote, then the arguments REPLACE still needs
    "SELECT replace(",
    "SELECT substr(lower(symbol), ",
    "SELECT first_value(abs(",  # a window function: OVER () after its parenthesis
    "SELECT count(",
    "SELECT 1 FROM trades WHERE EXISTS (",
    "WITH a AS (WITH b AS (WITH c AS (SELECT 1",  # nested CTEs, each with its own query
    "WITH a AS (WITH ",
    "WITH a AS (SELECT 1), ",
    "SELECT qty FROM trades WHERE qty IN (",
])
def test_closing_text_closes_calls_strings_and_ctes(dialect, prefix):
    """closing_text writes the whole rest of the statement for each of these prefixes (it wrote none: the
    completion search then walked the string's characters or the arguments token by token), and the statement
    it completes passes the scope guard and the validator."""
    text = closing_text(_scope(dialect, prefix))
    assert text is not None, prefix
    _scope(dialect, prefix + text).end()
    check_sql(prefix + text, DB, SQLPolicy(dialect=dialect))


@pytest.mark.parametrize("dialect", ["sqlite", "postgres"])
@pytest.mark.parametrize("prefix", [
    "WITH c AS (SELECT accounts.name",  # before the body's FROM: the body binds it
    "WITH c AS (SELECT t1.qty, name",
    "WITH c AS (SELECT 1), d AS (SELECT symbol",
])
def test_a_cte_body_closes_with_its_own_from(dialect, prefix):
    """A name a CTE body used before its FROM is bound by that body's FROM in the closing text, not left to the
    statement's query (the word written last is ended first, as SQLScopeGuard.closing_moves does)."""
    text = closing_text(_scope(dialect, prefix + " "))
    assert text is not None and text.index(" FROM ") < text.index(")"), (prefix, text)
    _scope(dialect, prefix + " " + text).end()
    check_sql(prefix + " " + text, DB, SQLPolicy(dialect=dialect))


@pytest.mark.parametrize("dialect", ["sqlite", "postgres"])
@pytest.mark.parametrize("prefix", [
    "WITH c AS (SELECT 1 WHERE accounts.",  # the walk's form: no FROM can follow WHERE
    "WITH c AS (SELECT 1 WHERE name",
    "WITH c AS (SELECT 1 FROM trades WHERE accounts.",
    "WITH c AS (SELECT 1), d AS (SELECT 1 GROUP BY accounts.",
    "WITH c AS (SELECT 1 WHERE EXISTS (SELECT 1 FROM trades WHERE accounts.",
])
def test_a_cte_body_past_its_from_binds_no_new_qualifier(dialect, prefix):
    """Past a CTE body's FROM (or where it has none) an undeclared qualifier or column is refused: the statement's
    query cannot bind it (its FROM is not in the body's scope). The scope guard recorded it as pending in the WITH
    clause's scope, and the query's SELECT dropped it: the walk of test_structured_goals_sql.py finished
    `WITH x AS (SELECT 1 WHERE accounts.[NaMe] ...), c1 AS (SELECT 0) SELECT 0`, which the validator refuses."""
    with pytest.raises(_Veto):
        _scope(dialect, prefix + " ")
    inner = closing_text(_scope(dialect, "WITH c AS (SELECT 1 WHERE 1 IN (SELECT accounts.id "))
    assert inner == " FROM accounts)) SELECT 0"  # (a subquery in the body still binds its own)


def test_a_search_from_inside_a_string_takes_the_closing_text_first(tokinfo):
    """From `SELECT concat(replace('ab` the completion search finds a path within 20 expansions (before, depth first
    through the string's characters: 2,000 expansions of ~10 ms masks on a Qwen vocabulary, and no path)."""
    spec = sql_spec(DB)
    compiled = ConstraintCache().get_or_compile(spec, tokinfo)
    ids = tokinfo.encode("SELECT concat(replace('ab")
    guard = SQLScopeGuard.from_grammar(spec.source, tokinfo, max_tokens=len(ids) + 24)
    m = compiled.new_matcher()
    assert all(m.consume(t) for t in ids)
    for t in ids:
        guard.consume(t)
    view = guard.path_view()
    path = shortest_completion(m.llg, tokinfo, 24, _hints(spec), allow=view.allows, max_nodes=20,
                               first=view.closing_moves)
    assert path is not None
    check_sql(tokinfo.decode(ids + path), DB)


def test_budget_word_check_leaves_a_cte_name_free(tokinfo):
    """Near the end of the budget the word check narrows operands to names that add no FROM item; a CTE's name after
    WITH's comma is no operand (`WITH a AS (...), b` was refused there: a guard dead end)."""
    grammar = sql_spec(DB).source
    ids = tokinfo.encode("WITH a AS (SELECT 1), b AS (SELECT 2) SELECT 1")
    assert SQLScopeGuard.from_grammar(grammar, tokinfo, max_tokens=len(ids) + 12).allows(ids, final=True)


def _calls(tokinfo, seed: int):
    """Random logits that favour opening calls, quotes and commas (what a random model wrote once new names were
    refused): nested calls and strings the output must still close in time."""
    texts = [tokinfo.decode([i]) for i in range(tokinfo.vocab_size)]
    boost = torch.tensor([4.0 * t.endswith("(") + 3.0 * ("'" in t) + 2.0 * (t.strip() == ",") for t in texts])
    gen = torch.Generator().manual_seed(seed)
    return lambda ids: torch.randn(tokinfo.vocab_size, generator=gen) + boost


@pytest.mark.parametrize("dialect", ["sqlite", "postgres"])
def test_random_proxy_decodes_close_inside_the_budget(tokinfo, dialect):
    """Greedy decodes over logits that nest calls and strings, 64 tokens, 12 seeds: each ends with EOS inside the
    budget and validates (before: sqlite seed 3 dead-ended on a CTE name, postgres seed 7 ran out inside nested
    CTEs)."""
    from evals.structured.driver import decode
    from gateway.structured.build import build_constraint

    spec, cache = sql_spec(DB, SQLPolicy(dialect=dialect)), ConstraintCache()
    for seed in range(12):
        c = build_constraint(spec, tokinfo, max_tokens=64, cache=cache)
        out = decode(c, _calls(tokinfo, seed), max_tokens=64)
        sql = tokinfo.decode([t for t in out.ids if t not in tokinfo.eos_ids])
        assert out.finished and len(out.ids) <= 64, (seed, sql, c.error)
        check_sql(sql, DB, SQLPolicy(dialect=dialect))
