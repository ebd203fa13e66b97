"""SQL decoding within max_tokens: the scope guard's budget rule (sql_budget.py), the alias rule for quoted table
names, and grammar/validator agreement found while probing short budgets."""

from __future__ import annotations

import json

import pytest

from gateway.structured.cache import ConstraintCache
from gateway.structured.errors import SQLPolicyViolation
from gateway.structured.sql_budget import MARGIN
from gateway.structured.sql_closing import closing_text
from gateway.structured.sql_grammar import sql_grammar, sql_spec
from gateway.structured.sql_guard import SQLScopeGuard
from gateway.structured.sql_schema import DatabaseSchema, SQLPolicy
from gateway.structured.sql_scope import WORDS_COMMENT, SQLScope, SQLWords, _Veto
from gateway.structured.sql_validate import check_sql

DB = DatabaseSchema.from_mapping({"trades": ["id", "account_id", "symbol", "qty"], "accounts": ["id", "name"]})


def _scope(dialect: str) -> SQLScope:
    g = sql_grammar(DB, SQLPolicy(dialect=dialect))
    at = g.find(WORDS_COMMENT)
    words = SQLWords.from_json(json.loads(g[at + len(WORDS_COMMENT):].split("\n", 1)[0]))
    return SQLScope({t: frozenset(c) for t, c in DB.tables.items()}, False, words)


def _guard_accepts(dialect: str, sql: str) -> bool:
    s = _scope(dialect)
    try:
        s.feed(sql)
        s.end()
    except _Veto:
        return False
    return True


def _sqlglot_accepts(dialect: str, sql: str) -> bool:
    try:
        check_sql(sql, DB, SQLPolicy(dialect=dialect))
    except SQLPolicyViolation:
        return False
    return True


@pytest.mark.parametrize("dialect", ["sqlite", "postgres"])
@pytest.mark.parametrize("sql", [
    'SELECT 1 FROM trades, "trades", "trades" trades',  # the repeat's alias is the first one's name
    'SELECT 1 FROM trades, "trades"',  # unaliased repeats: sqlglot names the second trades_2
    'SELECT 1 FROM "trades" t, "trades" AS t',
    'SELECT 1 FROM trades, "trades" AS x, "trades" x2',
    'SELECT 1 FROM "trades" trades',
    "SELECT 1 FROM trades, trades trades",
])
def test_guard_refuses_the_repeated_aliases_sqlglot_refuses(dialect, sql):
    """A double-quoted table name in FROM is a table in SQLite too (the guard read it as a string literal there,
    so `FROM trades, "tRADEs", "TRADEs" tRADES` passed the guard and failed sqlglot's "Alias already used")."""
    assert _guard_accepts(dialect, sql) is _sqlglot_accepts(dialect, sql), sql


def test_sqlite_quoted_table_spellings_fold_like_sqlglot():
    sql = 'SELECT 1 FROM trades, "tRADEs", "TRADEs" tRADES'
    assert not _sqlglot_accepts("sqlite", sql) and not _guard_accepts("sqlite", sql)
    assert _sqlglot_accepts("sqlite", 'SELECT 1 FROM trades, "tRADEs"') and _guard_accepts("sqlite", 'SELECT 1 FROM trades, "tRADEs"')


def test_budget_refuses_names_whose_closing_cannot_fit(tokinfo):
    """With max_tokens, a new unbound qualifier is admitted only while the tokens left cover the text that binds
    it: a prefix that piles them up is cut where the next one would not fit, and every admitted prefix's closing
    text (in the tokenizer's tokens) fits the tokens left with the margin."""
    grammar = sql_spec(DB).source
    ids = tokinfo.encode("SELECT " + ", ".join(f"q{i}.x{i}" for i in range(12)))
    assert SQLScopeGuard.from_grammar(grammar, tokinfo).allows(ids, final=False)
    budget = len(ids) + 40
    guard = SQLScopeGuard.from_grammar(grammar, tokinfo, max_tokens=budget)
    admitted = max(k for k in range(len(ids) + 1) if guard.allows(ids[:k], final=False))
    assert 0 < admitted < len(ids)
    state = guard.path_view().state(ids[:admitted])
    cost = len(tokinfo.encode(closing_text(state)))
    assert cost + MARGIN <= budget - admitted, (cost, budget - admitted)


def _piling(tokinfo, seed: int):
    """Random logits that favour qualifier tokens (`x.`), commas and short names: they pile up unbound qualifiers."""
    import torch

    texts = [tokinfo.decode([i]) for i in range(tokinfo.vocab_size)]
    boost = torch.tensor([5.0 * t.endswith(".") + 3.0 * (t.strip() == ",") + 2.0 * (t.isalnum() and len(t) <= 2)
                          for t in texts])
    gen = torch.Generator().manual_seed(seed)
    return lambda ids: torch.randn(tokinfo.vocab_size, generator=gen) + boost


@pytest.mark.parametrize("dialect", ["sqlite", "postgres"])
def test_small_budget_decodes_that_pile_up_qualifiers_end_valid(tokinfo, dialect):
    """48 tokens of greedy decoding over logits that pile up qualifiers: every output ends inside the budget and
    validates (before the budget rule, seed 12 wrote `SUC.FT+...,amdo.h1+...` and could not bind both in time)."""
    from evals.structured.driver import decode
    from gateway.structured.build import build_constraint

    spec, cache = sql_spec(DB, SQLPolicy(dialect=dialect)), ConstraintCache()
    for seed in range(24):
        c = build_constraint(spec, tokinfo, max_tokens=48, cache=cache)
        out = decode(c, _piling(tokinfo, seed), max_tokens=48)
        sql = tokinfo.decode([t for t in out.ids if t not in tokinfo.eos_ids])
        assert out.finished, (seed, sql, c.error)
        check_sql(sql, DB, SQLPolicy(dialect=dialect))


def test_budget_leaves_bound_names_free(tokinfo):
    """Names that add no FROM item (columns of a table FROM bound) are never refused for the budget."""
    grammar = sql_spec(DB).source
    ids = tokinfo.encode("SELECT count(*) FROM trades AS t WHERE t.qty > 1 AND t.id = 2 AND t.symbol = 'A'")
    assert SQLScopeGuard.from_grammar(grammar, tokinfo, max_tokens=len(ids) + 1).allows(ids, final=True)


def test_replace_is_a_function_not_a_statement():
    """sqlglot parses REPLACE(x, a, b) to its Replace node: the read-only check forbade it as if it were REPLACE INTO."""
    assert check_sql("SELECT replace(symbol, 'a', 'b') FROM trades", DB).tables == {"trades"}
    with pytest.raises(SQLPolicyViolation):
        check_sql("REPLACE INTO trades VALUES (1)", DB, SQLPolicy(dialect="mysql"))


def test_an_aggregate_allow_list_admits_no_empty_operand(tokinfo):
    """With only aggregates allowed the grammar's other-calls rule was empty, so `SELECT ` was a whole query."""
    compiled = ConstraintCache().get_or_compile(sql_spec(DB, SQLPolicy(allowed_functions=("count", "sum"))), tokinfo)
    m = compiled.new_matcher()
    assert all(m.consume(t) for t in tokinfo.encode("SELECT ")) and not m.is_accepting()
    m = compiled.new_matcher()
    assert all(m.consume(t) for t in tokinfo.encode("SELECT count(*) FROM trades")) and m.is_accepting()


def test_word_pool_holds_only_words_the_grammar_continues():
    """Where words are checked: no query after an aggregate's "(", no NOT / EXISTS after an operator, and no
    function named like a keyword (Postgres' RIGHT is no call in the grammar)."""
    s = _scope("postgres")
    s.feed("SELECT id FROM trades WHERE qty = ")
    pool = s.word_pool()
    assert "not" not in pool.words and "exists" not in pool.words and "right" not in pool.words
    s = _scope("sqlite")
    s.feed("SELECT id FROM trades WHERE qty > sum(")
    assert "select" not in s.word_pool().words


@pytest.mark.parametrize("dialect", ["sqlite", "postgres"])
def test_value_argument_functions_take_no_predicate(tokinfo, dialect):
    """sqlglot parses TRIM / SUBSTRING (and Postgres' DATE_PART) with a syntax of their own and rejects a
    predicate argument there: the grammar offers values only, and the word check no NOT / EXISTS."""
    compiled = ConstraintCache().get_or_compile(sql_spec(DB, SQLPolicy(dialect=dialect)), tokinfo)

    def accepts(sql: str) -> bool:
        m = compiled.new_matcher()
        return all(m.consume(t) for t in tokinfo.encode(sql)) and m.is_accepting()

    assert accepts("SELECT trim(symbol), substring(symbol, 1, 2) FROM trades")
    assert _sqlglot_accepts(dialect, "SELECT trim(symbol), substring(symbol, 1, 2) FROM trades")
    for sql in ("SELECT trim(qty = 1) FROM trades", "SELECT substring(symbol, qty > 1) FROM trades"):
        assert not accepts(sql) and not _sqlglot_accepts(dialect, sql), sql
    s = _scope(dialect)
    s.feed("SELECT 1 FROM trades WHERE trim(")
    assert "not" not in s.word_pool().words and "exists" not in s.word_pool().words


def test_after_an_unjoined_alias_no_word_goes_only_to_a_banned_keyword():
    """`FROM prices arguments O` with names unbound: O can only become ORDER there (ON needs a JOIN before it, OUTER a
    LEFT / RIGHT / FULL), which may not start yet, so it is refused where it starts (it was a dead end)."""
    s = _scope("sqlite")
    s.feed("SELECT q.id FROM trades t")
    with pytest.raises(_Veto):
        s.clone().feed(" O")
    s = _scope("sqlite")
    s.feed("SELECT q.id FROM trades t JOIN accounts a")
    s.clone().feed(" O")  # ON
