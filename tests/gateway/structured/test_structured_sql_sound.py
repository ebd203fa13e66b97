"""SQL constraint soundness and coverage: what grammar + scope guard admit parses and validates (random
walks), dialect functions / window functions / LIMIT forms / CTE names / quoted names are admitted,
and no write, DDL or session statement gets through."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evals.structured.sql_walks import random_walks
from gateway.structured.cache import ConstraintCache
from gateway.structured.errors import SQLPolicyViolation
from gateway.structured.sql_grammar import sql_spec
from gateway.structured.sql_guard import SQLScopeGuard
from gateway.structured.sql_schema import DatabaseSchema, SQLPolicy
from gateway.structured.sql_validate import check_sql

DB = DatabaseSchema.from_mapping({
    "accounts": ["id", "name", "region"],
    "trades": ["id", "account_id", "symbol", "qty", "price", "ts"],
    "Laboratory": ["ID", "T-CHO", "Date"],
})
ADVERSARIAL = json.loads((Path(__file__).parents[3] / "evals/structured/data/sql_adversarial.json").read_text())


def _admitted(tokinfo, sql: str, policy: SQLPolicy) -> bool:
    """Grammar, scope guard and validator together."""
    compiled = ConstraintCache().get_or_compile(sql_spec(DB, policy), tokinfo)
    ids = tokinfo.encode(sql)
    m = compiled.new_matcher()
    if not (all(m.consume(t) for t in ids) and m.is_accepting()):
        return False
    if not SQLScopeGuard.from_grammar(compiled.spec.source, tokinfo).allows(ids, final=True):
        return False
    try:
        check_sql(sql, DB, policy)
        return True
    except SQLPolicyViolation:
        return False


@pytest.mark.parametrize("dialect", ["sqlite", "postgres"])
def test_random_walks_always_parse_and_validate(tokinfo, dialect):
    report = random_walks(tokinfo, DB, dialect, walks=12, max_tokens=96, seed=3)
    assert report.valid == report.finished, report.examples
    assert report.finished >= 1


@pytest.mark.parametrize("sql", [
    "SELECT strftime('%Y', ts), iif(qty > 1, 1, 0), julianday(ts) FROM trades",
    "SELECT symbol, rank() OVER (PARTITION BY account_id ORDER BY qty DESC) FROM trades",
    "SELECT instr(symbol, 'A'), date(ts), datetime(ts) FROM trades LIMIT 9, 2",
    "WITH recent AS (SELECT account_id, max(ts) AS last_ts FROM trades GROUP BY account_id) "
    "SELECT a.name, r.account_id FROM accounts AS a JOIN recent AS r ON a.id = r.account_id",
    "SELECT T2.`T-CHO` FROM Laboratory AS T2",
    "SELECT Laboratory.`T-CHO` FROM Laboratory",
    "SELECT count(*) FROM (SELECT symbol FROM trades GROUP BY symbol) AS t1",
    "SELECT symbol, sum(qty) AS n FROM trades GROUP BY symbol HAVING sum(qty) > 10 ORDER BY n DESC",
    "SELECT symbol, sum(qty) AS n FROM trades GROUP BY symbol HAVING n > 10",  # a SELECT alias
    # CTE and derived-table columns after their qualifier (declared before or after the SELECT list)
    "WITH recent AS (SELECT account_id, max(ts) AS last_ts FROM trades GROUP BY account_id) "
    "SELECT a.name, r.last_ts FROM accounts AS a JOIN recent AS r ON a.id = r.account_id",
    "SELECT t1.max_qty FROM (SELECT max(qty) AS max_qty FROM trades) AS t1",
    "SELECT T1.symbol FROM (SELECT symbol, count(*) AS max_count FROM trades GROUP BY symbol) AS T1 "
    "WHERE T1.max_count > 2 ORDER BY T1.max_count DESC",
    "WITH a AS (SELECT id, name FROM accounts), b AS (SELECT account_id, sum(qty) AS total FROM trades "
    "GROUP BY account_id) SELECT a.name, b.total FROM a JOIN b ON a.id = b.account_id ORDER BY b.total DESC",
    "SELECT CAST(SUM(IIF(T1.qty > 1, 1, 0)) AS REAL) * 100 / COUNT(T1.id) FROM trades AS T1 "
    "INNER JOIN accounts AS T2 ON T1.account_id = T2.id WHERE STRFTIME('%Y', T1.ts) = '2012'",
    "SELECT symbol, qty FROM trades ORDER BY 2 DESC, 1",
    "SELECT qty - -1, -qty, qty-1 FROM trades",
    "SELECT t1.qty, t2.qty FROM trades AS t1 JOIN trades AS t2 ON t1.id = t2.id",  # a self-join, two aliases
    "SELECT trades.qty FROM trades AS trades",  # a table aliased by its own name
    "SELECT trades.qty FROM trades AS trades JOIN accounts ON accounts.id = trades.account_id",
    "SELECT trades.qty FROM trades trades",
    "SELECT trades.qty FROM trades JOIN trades AS t2 ON trades.id = t2.id",  # the first keeps its name
])
def test_sqlite_real_world_forms_admitted(tokinfo, sql):
    assert _admitted(tokinfo, sql, SQLPolicy(dialect="sqlite", max_limit=None)), sql


@pytest.mark.parametrize("sql", [
    'SELECT "T-CHO" FROM "laboratory"',
    "SELECT symbol, dense_rank() OVER (ORDER BY qty) FROM trades LIMIT 5 OFFSET 2",
    "SELECT date_trunc('day', ts), greatest(qty, 1), split_part(symbol, '.', 1) FROM trades",
])
def test_postgres_forms_admitted(tokinfo, sql):
    assert _admitted(tokinfo, sql, SQLPolicy(dialect="postgres", max_limit=None)), sql


@pytest.mark.parametrize("sql", [
    "SELECT lower(symbol, symbol) FROM trades",  # arity from sqlglot's parser
    "SELECT rank() FROM trades",  # a window function needs OVER
    "SELECT T9.qty FROM trades AS T1",  # unbound qualifier
    "SELECT id FROM accounts JOIN trades ON accounts.id = trades.account_id",  # ambiguous column
    "SELECT qty FROM accounts",  # a column of a table not in FROM
    "SELECT * FROM recent",  # not a table, no such CTE
    "SELECT '" + "''" * 70 + "' FROM trades",  # a string literal past 64 characters
    "SELECT t1.nope FROM (SELECT max(qty) AS max_qty FROM trades) AS t1",  # not a column of the derived table
    "SELECT r.qty FROM (SELECT symbol FROM trades) AS r",
    "SELECT symbol, qty FROM trades ORDER BY 3",  # an output position past the SELECT list
    "SELECT symbol FROM trades GROUP BY 0",
    "SELECT qty--1 FROM trades",  # `--` starts a comment: the rest of the line would vanish
    "SELECT - -qty FROM trades",
    "SELECT t.*",  # a qualifier nothing declares
    "SELECT 1 AS t ORDER BY t, rpad\t ()",  # too few arguments, `(` and `)` in one token
    "SELECT a.qty FROM trades AS a JOIN accounts AS a ON a.id = a.id",  # an alias used twice in one FROM
    "SELECT trades.qty FROM trades JOIN accounts AS trades ON trades.id = trades.account_id",  # a table's own name
    "SELECT trades.qty FROM trades JOIN trades AS trades ON trades.id = 1",  # ... taken by the first trades
    "SELECT trades.qty FROM trades AS t",  # the qualifier lost its table to the alias
])
def test_unsound_forms_refused(tokinfo, sql):
    assert not _admitted(tokinfo, sql, SQLPolicy(dialect="sqlite", max_limit=None)), sql


def test_validator_reads_functions_as_written():
    """STRFTIME parses to sqlglot's TimeToStr: allowed because strftime is; a narrowed list refuses it."""
    check_sql("SELECT strftime('%Y', ts) FROM trades", DB)
    with pytest.raises(SQLPolicyViolation) as err:
        check_sql("SELECT strftime('%Y', ts) FROM trades", DB, SQLPolicy(allowed_functions=("count",)))
    assert err.value.rule == "function_not_allowed"


@pytest.mark.parametrize("dialect", ["sqlite", "postgres"])
def test_adversarial_set_never_admitted(tokinfo, dialect):
    schema = DatabaseSchema.from_mapping(ADVERSARIAL["schema"])
    policy = SQLPolicy(dialect=dialect)
    compiled = ConstraintCache().get_or_compile(sql_spec(schema, policy), tokinfo)
    for sql in ADVERSARIAL["must_reject"]:  # neither grammar + guard nor the validator admits any
        ids = tokinfo.encode(sql)
        m = compiled.new_matcher()
        grammar = all(m.consume(t) for t in ids) and m.is_accepting()
        assert not (grammar and SQLScopeGuard.from_grammar(compiled.spec.source, tokinfo).allows(ids, final=True)), sql
        with pytest.raises(SQLPolicyViolation):
            check_sql(sql, schema, policy)


@pytest.mark.parametrize("dialect", ["sqlite", "postgres"])
def test_adversarial_must_accept_admitted(tokinfo, dialect):
    import sqlglot

    schema = DatabaseSchema.from_mapping(ADVERSARIAL["schema"])
    policy = SQLPolicy(dialect=dialect, max_limit=None)
    compiled = ConstraintCache().get_or_compile(sql_spec(schema, policy), tokinfo)
    for sql in ADVERSARIAL["must_accept"]:
        sql = sqlglot.transpile(sql, read="sqlite", write=dialect)[0]
        ids = tokinfo.encode(sql)
        m = compiled.new_matcher()
        assert all(m.consume(t) for t in ids) and m.is_accepting(), sql
        assert SQLScopeGuard.from_grammar(compiled.spec.source, tokinfo).allows(ids, final=True), sql
        check_sql(sql, schema, policy)


@pytest.mark.parametrize("prefix", [
    "SELECT t1.max_qty",  # a derived table's column before the derived table
    "SELECT tickerSELECTSELECTx.T tickerSELECT FROM trades tickerSELECTx inneR join trades tickerSELECTSELECT",
    "SELECT t1.max_qty FROM (SELECT q.ab",  # two scopes with qualifiers still to declare
    "SELECT zz.a, symbol + 1, t9.*",
    "WITH r AS (SELECT zz.a, 1 + (2",
])
def test_admitted_prefixes_close_within_a_small_budget(tokinfo, prefix):
    """Liveness: where grammar and guard admit a prefix, the completion search finds a closing path that
    declares what it left unbound (the guard's own closing texts), and the closed query validates."""
    from gateway.structured.build import build_constraint

    c = build_constraint(sql_spec(DB, SQLPolicy(dialect="sqlite")), tokinfo, max_tokens=256, cache=ConstraintCache())
    ids = tokinfo.encode(prefix)
    assert c.guard.allows(ids, final=False), prefix
    for t in ids:
        assert c.consume(t), prefix
    from gateway.structured.closing import shortest_completion

    path = shortest_completion(c.matcher.llg, tokinfo, 80, allow=c.guard.allows, first=c.guard.closing_moves)
    assert path is not None, prefix
    check_sql(tokinfo.decode(ids + path), DB, SQLPolicy(dialect="sqlite"))


@pytest.mark.parametrize("prefix, closers", [
    ("SELECT id FROM trades WHERE symbol = ", None),  # nothing open: no tier applies
    ("SELECT id FROM trades WHERE symbol = 'AA", "'"),  # inside a string: its quote first
    ("SELECT id FROM trades WHERE qty > (1 + ", None),  # a number or name must come first: `)` not allowed yet
    ("SELECT id FROM trades WHERE qty > (1 + 2", ")"),
])
def test_sql_closing_window_prefers_only_real_closers(tokinfo, prefix, closers):
    """In the closing window an SQL row keeps `"` and `,` tokens no preference (they open a quoted name or
    string and a new item); inside a string its closing quote leads, else `)` where it is allowed."""
    import numpy as np
    import torch

    from gateway.structured.bitmask import bitmask_words
    from gateway.structured.build import build_constraint

    spec = sql_spec(DB, SQLPolicy(dialect="sqlite"))
    ids = tokinfo.encode(prefix)
    rows = {}
    for budget in (len(ids) + 200, len(ids) + 8):  # outside / inside the closing window
        c = build_constraint(spec, tokinfo, max_tokens=budget, cache=ConstraintCache())
        c.planner.next_check = budget  # (no completion path forced: the tiers alone)
        c.guard.scope.budget = None  # (the guard's budget rule would not admit the prefix's names in so few tokens)
        for t in ids:
            assert c.consume(t), prefix
        row = torch.empty(1, bitmask_words(c.vocab_size), dtype=torch.int32)
        c.fill_bitmask(row, 0)
        rows[budget > len(ids) + 8] = np.unpackbits(row[0].numpy().view(np.uint8), bitorder="little").astype(bool)
    free, closing = rows[True], rows[False]
    texts = [tokinfo.decode([int(i)]) for i in np.flatnonzero(closing)[:2000]]
    if closers is None:
        assert np.array_equal(free, closing), prefix
        assert not all(t.startswith(('"', ",")) for t in texts)
    else:
        assert closing.sum() < free.sum() and all(t.startswith(closers) and set(t) <= set(")" + closers)
                                                    for t in texts), (prefix, texts[:20])


@pytest.mark.parametrize("prefix", ["SELECT b.x, *", "SELECT b.x, t.*", "SELECT *, b.x AS upper"])
def test_no_word_after_a_star_or_alias_grows_only_into_a_banned_clause(tokinfo, prefix):
    """After a `*` item (as after an alias) with `b` unbound, ` IN` can only become INTERSECT: refused
    where it starts (a random walk met it as a dead end: every next token vetoed), FROM still allowed."""
    guard = SQLScopeGuard.from_grammar(sql_spec(DB, SQLPolicy(dialect="sqlite")).source, tokinfo)
    ids = tokinfo.encode(prefix)
    assert guard.allows(ids, final=False), prefix
    assert not guard.allows(ids + tokinfo.encode(" IN"), final=False), prefix
    assert guard.allows(ids + tokinfo.encode(" FROM"), final=False), prefix


def test_no_word_after_a_using_list_grows_only_into_a_banned_clause(tokinfo):
    """After `USING (...)` with `v` unbound, `G` could only become GROUP (GLOB does not follow a source): refused
    where it starts (greedy decoding on the demo model met it as a dead end), a join still allowed."""
    guard = SQLScopeGuard.from_grammar(sql_spec(DB, SQLPolicy(dialect="sqlite")).source, tokinfo)
    prefix = "SELECT sum(v.x) FROM trades JOIN accounts AS a USING (id) "
    ids = tokinfo.encode(prefix)
    assert guard.allows(ids, final=False)
    assert not guard.allows(tokinfo.encode(prefix + "G"), final=False)
    assert guard.allows(tokinfo.encode(prefix + "JOIN (SELECT 1 AS x) AS v ON 1 = 1"), final=False)
    assert guard.allows(tokinfo.encode(prefix + "LEFT JOIN"), final=False)


@pytest.mark.parametrize("dialect", ["sqlite", "postgres"])
def test_a_call_argument_does_not_start_a_query(tokinfo, dialect):
    """`abs(SELECT` is no subquery (the grammar takes SELECT there only as the start of a name, which nothing in
    scope is): refused where it starts (greedy decoding on the demo model met it as a dead end); a subquery in its
    own parentheses stays allowed."""
    guard = SQLScopeGuard.from_grammar(sql_spec(DB, SQLPolicy(dialect=dialect)).source, tokinfo)
    assert not guard.allows(tokinfo.encode("SELECT qty FROM trades WHERE abs(SELECT"), final=False)
    assert guard.allows(tokinfo.encode("SELECT qty FROM trades WHERE abs((SELECT max(qty) FROM trades)) > 1"),
                        final=True)
    assert guard.allows(tokinfo.encode("SELECT qty FROM trades WHERE qty IN (SELECT qty FROM trades)"), final=True)
