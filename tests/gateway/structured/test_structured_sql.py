"""SQL: schema grammar (only real names), sqlglot read-only policy, columns, LIMIT, transpile."""

from __future__ import annotations

import pytest

from evals.structured.driver import decode, random_logits
from gateway.structured.build import build_constraint
from gateway.structured.cache import ConstraintCache
from gateway.structured.errors import SQLPolicyViolation
from gateway.structured.sql_grammar import sql_spec
from gateway.structured.sql_schema import DatabaseSchema, SQLPolicy
from gateway.structured.sql_validate import check_sql

DB = DatabaseSchema.from_mapping({
    "accounts": ["id", "name", "region"],
    "trades": ["id", "account_id", "symbol", "qty", "price", "ts"],
    "positions": ["account_id", "symbol", "qty", "Market Value"],
})

ADVERSARIAL = [
    ("DELETE FROM trades", "read_only"),
    ("UPDATE trades SET qty = 0", "read_only"),
    ("INSERT INTO trades (id) VALUES (1)", "read_only"),
    ("DROP TABLE trades", "read_only"),
    ("CREATE TABLE x (a INT)", "read_only"),
    ("ALTER TABLE trades ADD COLUMN y INT", "read_only"),
    ("SELECT * INTO backup FROM trades", "read_only"),
    ("ATTACH DATABASE '/tmp/evil.db' AS evil", "read_only"),
    ("PRAGMA table_info(trades)", "read_only"),
    ("COPY trades TO '/tmp/out.csv'", "read_only"),
    ("GRANT ALL ON trades TO mallory", "read_only"),
    ("SET search_path = evil", "read_only"),
    ("VACUUM", "read_only"),
    ("BEGIN", "read_only"),
    ("SELECT * FROM trades FOR UPDATE", "read_only"),
    ("WITH d AS (DELETE FROM trades RETURNING *) SELECT * FROM d", "read_only"),
    ("SELECT id FROM trades; DROP TABLE trades", "single_statement"),
    ("SELECT 1; SELECT 2", "single_statement"),
    ("SELECT load_extension('/tmp/x.so')", "function_not_allowed"),
    ("SELECT readfile('/etc/passwd') FROM trades", "function_not_allowed"),
    ("SELECT * FROM sqlite_master", "unknown_table"),
    ("SELECT id FROM trades LIMIT (SELECT 1)", "limit"),
    ("SELECT", "parse"),  # sqlglot parses an empty SELECT list; no database runs it
    ("SELECT id FROM trades WHERE id IN (SELECT)", "parse"),
]


@pytest.mark.parametrize("sql, rule", ADVERSARIAL)
def test_adversarial_rejected(sql, rule):
    with pytest.raises(SQLPolicyViolation) as err:
        check_sql(sql, DB, SQLPolicy(dialect="sqlite"))
    assert err.value.rule == rule and err.value.http_status == 400


@pytest.mark.parametrize("sql", [
    "SELECT secret FROM trades",
    "SELECT t.nope FROM trades AS t",
    "SELECT a.id FROM accounts AS a JOIN trades AS t ON a.id = t.missing",
    "SELECT symbol FROM trades WHERE region = 'EU'",  # column of another table
])
def test_unknown_columns_rejected(sql):
    with pytest.raises(SQLPolicyViolation) as err:
        check_sql(sql, DB)
    assert err.value.rule == "unknown_column"


def test_limit_enforced_and_transpiled():
    r = check_sql('SELECT a.name, SUM(t.qty * t.price) AS notional FROM accounts AS a JOIN trades AS t '
                  'ON a.id = t.account_id GROUP BY a.name HAVING SUM(t.qty) > 10 ORDER BY notional DESC '
                  'LIMIT 5000', DB, SQLPolicy(dialect="sqlite", target_dialect="postgres", max_limit=100))
    assert r.sql.endswith("LIMIT 100") and r.rewrites == ["clamped LIMIT 5000 to 100"]
    assert {"trades.qty", "trades.price", "accounts.name"} <= r.columns
    r = check_sql('SELECT "Market Value" FROM positions', DB, SQLPolicy(target_dialect="mysql", max_limit=10))
    assert r.sql == "SELECT `Market Value` FROM positions LIMIT 10" and r.rewrites == ["added LIMIT 10"]


def test_sqlite_double_quoted_unknown_name_is_a_string():
    r = check_sql('SELECT id FROM accounts WHERE region = "EU"', DB, SQLPolicy(target_dialect="postgres"))
    assert r.sql == "SELECT id FROM accounts WHERE region = 'EU' LIMIT 1000"
    assert any("string literal" in w for w in r.rewrites)


GOOD = [
    "SELECT * FROM trades",
    "select symbol, count(*) from trades group by symbol having count(*) > 2 order by 2 desc limit 3",
    "SELECT T1.name FROM accounts AS T1 JOIN trades AS T2 ON T1.id = T2.account_id WHERE T2.qty BETWEEN 1 AND 5",
    "WITH cte_big AS (SELECT account_id FROM trades WHERE qty > 100) SELECT name FROM accounts WHERE id IN "
    "(SELECT account_id FROM cte_big)",
    "SELECT symbol FROM trades UNION SELECT symbol FROM positions EXCEPT SELECT 'X'",
    "SELECT avg(price), max(qty) FROM trades WHERE symbol LIKE 'A%' AND NOT ts IS NULL",
    'SELECT "Market Value" FROM positions;',
]


def _accepts(compiled, tokinfo, sql: str) -> bool:
    """Grammar and scope guard together (what decoding admits)."""
    from gateway.structured.sql_guard import SQLScopeGuard

    m = compiled.new_matcher()
    ids = tokinfo.encode(sql)
    if not (all(m.consume(t) for t in ids) and m.is_accepting()):
        return False
    guard = SQLScopeGuard.from_grammar(compiled.spec.source, tokinfo)
    return guard.allows(ids, final=True)


def test_grammar_accepts_select_language_and_only_real_names(tokinfo):
    cache = ConstraintCache()
    compiled = cache.get_or_compile(sql_spec(DB), tokinfo)
    for sql in GOOD:
        assert _accepts(compiled, tokinfo, sql), sql
        check_sql(sql, DB)  # and the validator agrees
    for sql in ["SELECT secret FROM trades", "SELECT * FROM users", "DELETE FROM trades",
                "SELECT id FROM trades; DROP TABLE trades", "SELECT Market Value FROM positions",
                "SELECT * FROM big",
                # a qualifier and its column are one name: no whitespace around the dot (the alias
                # guard reads `t .x` as two names and would let an unbound qualifier through)
                "SELECT t .id FROM trades AS t", "SELECT t.\n\nid FROM trades AS t", "SELECT t . * FROM trades AS t"]:
        assert not _accepts(compiled, tokinfo, sql), sql


def test_random_model_sql_always_parses_and_names_only_real_tables(tokinfo):
    """Random-logit SQL is always one parseable read-only SELECT over real tables, and its
    qualifiers are bound (sql_scope.py): only a step where the guard had to stand aside (it vetoed
    every token; counted in guard_fallbacks) may leave one unbound, which sqlglot then rejects."""
    spec = sql_spec(DB)
    cache = ConstraintCache()
    done = 0
    for seed in range(8):
        c = build_constraint(spec, tokinfo, max_tokens=128, cache=cache)
        out = decode(c, random_logits(tokinfo.vocab_size, seed), max_tokens=128)
        if not out.finished:
            continue
        done += 1
        sql = tokinfo.decode(out.ids[:-1])
        try:
            result = check_sql(sql, DB, SQLPolicy())
        except SQLPolicyViolation as e:
            assert e.rule == "unknown_column", (e.rule, sql)  # positional or unqualified columns
            continue
        assert result.tables <= set(DB.tables)
    assert done >= 1


def test_grammar_per_dialect_and_function_allow_list(tokinfo):
    cache = ConstraintCache()
    pg = cache.get_or_compile(sql_spec(DB, SQLPolicy(dialect="postgres")), tokinfo)
    my = cache.get_or_compile(sql_spec(DB, SQLPolicy(dialect="mysql")), tokinfo)
    assert _accepts(pg, tokinfo, 'SELECT "Market Value" FROM positions WHERE symbol = \'X\'')
    assert not _accepts(pg, tokinfo, "SELECT `Market Value` FROM positions")
    assert not _accepts(pg, tokinfo, 'SELECT id FROM trades WHERE symbol = "X"')  # "X" is an identifier there
    assert _accepts(my, tokinfo, "SELECT `Market Value` FROM positions")
    narrow = cache.get_or_compile(sql_spec(DB, SQLPolicy(allowed_functions=("count", "sum"))), tokinfo)
    assert _accepts(narrow, tokinfo, "SELECT count(*), sum(qty) FROM trades")
    assert not _accepts(narrow, tokinfo, "SELECT lower(symbol) FROM trades")
    assert not _accepts(narrow, tokinfo, "SELECT avg(qty) FROM trades")


def test_allowed_tables_narrow_grammar_and_validator(tokinfo):
    policy = SQLPolicy(allowed_tables=("trades",))
    compiled = ConstraintCache().get_or_compile(sql_spec(DB, policy), tokinfo)
    assert _accepts(compiled, tokinfo, "SELECT symbol FROM trades")
    assert not _accepts(compiled, tokinfo, "SELECT name FROM accounts")
    with pytest.raises(SQLPolicyViolation) as err:
        check_sql("SELECT name FROM accounts", DB, policy)
    assert err.value.rule == "table_not_allowed"


def test_alias_guard_binds_qualifiers(tokinfo):
    """A qualifier must be declared by FROM (before or after its use), with a table that has its column."""
    from gateway.structured.sql_guard import SQLScopeGuard

    grammar = sql_spec(DB).source
    ok = ["SELECT T1.id FROM trades AS T1", "SELECT trades.id FROM trades",
          "SELECT a.id FROM trades AS a WHERE a.id > 1",
          "SELECT t1.id FROM trades AS t1 JOIN trades AS t2 ON t1.id = t2.id"]
    bad = ["SELECT x.id FROM trades AS y", "SELECT trades.id FROM positions",
           "SELECT id FROM trades AS y WHERE x.id = 1", "SELECT T1.nosuch FROM trades AS T1",
           "SELECT a.id FROM trades AS a JOIN accounts AS a ON a.id = a.id",  # an alias used twice in one FROM
           "SELECT trades.id FROM trades JOIN accounts AS trades ON trades.id = 1"]  # a table's own name taken
    for sql, want in [(s, True) for s in ok] + [(s, False) for s in bad]:
        guard = SQLScopeGuard.from_grammar(grammar, tokinfo)
        assert guard.allows(tokinfo.encode(sql), final=True) is want, sql


def test_failed_completion_searches_stop_at_their_time_limit(tokinfo, monkeypatch):
    """An output that wrote more unbound qualifiers than its budget can bind cannot be closed: once failed searches
    have cost PLAN_SEARCH_LIMIT_S the planner stops searching (each search took seconds on a real vocabulary, every
    4 tokens of the closing window: a 504 instead of a quick validation error), and the output still ends in budget."""
    import numpy as np

    import gateway.structured.closing_planner as planner
    from gateway.structured.bitmask import allocate_bitmask

    monkeypatch.setattr(planner, "PLAN_SEARCH_LIMIT_S", 0.0)
    prefix = tokinfo.encode("SELECT " + ", ".join(f"q{i}.x{i}" for i in range(8)))
    budget = len(prefix) + 40
    c = build_constraint(sql_spec(DB), tokinfo, max_tokens=budget, cache=ConstraintCache())
    c.guard.scope.budget = None  # (the guard's budget rule admits no such prefix: lifted to reach the state)
    for t in prefix:
        assert c.consume(t)
    bm = allocate_bitmask(1, tokinfo.vocab_size)
    for _ in range(budget - len(prefix)):
        bm.zero_()
        c.fill_bitmask(bm, 0)
        allowed = np.flatnonzero(np.unpackbits(bm[0].numpy().view(np.uint8), bitorder="little")[:tokinfo.vocab_size])
        token = int(allowed[0])
        if token in tokinfo.eos_ids:
            break
        assert c.consume(token)
    assert c.plan_failures == 1 and c.plan_searches == 1, (c.plan_failures, c.plan_searches)


def test_nesting_past_the_parsers_depth_is_a_typed_error():
    """sqlglot and json recurse once per nesting level: a deep output is a validation error, not a 500."""
    from gateway.structured.errors import StructuredValidationError
    from gateway.structured.validate import validate_json, validate_tool_calls

    with pytest.raises(SQLPolicyViolation) as err:
        check_sql("SELECT " + "(" * 5000 + "1" + ")" * 5000 + " FROM trades", DB)
    assert err.value.rule == "parse"
    with pytest.raises(StructuredValidationError, match="nested too deeply"):
        validate_json("[" * 100000 + "]" * 100000, {"type": "array"})
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(StructuredValidationError):
        validate_tool_calls('<tool_call>\n{"name": "f", "arguments": {"a": ' + "[" * 100000 + "]" * 100000 + "}}\n</tool_call>",
                            [tool], "required")
