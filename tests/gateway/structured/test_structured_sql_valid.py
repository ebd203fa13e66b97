"""What the gateway returns as validated SQL passes the same check again (issue #25, "never an invalid output").

The gateway validates the decoded text and returns `check_sql(...).sql`: rewritten (LIMIT, SQLite's quoted strings)
and written back by sqlglot. That text was never checked: SQLite's SUBSTR(a OR b) came back as SUBSTRING(a OR b),
which SUBSTRING's own FROM/FOR parser refuses, so a 200's SQL failed a fresh check_sql with the same options."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gateway.plan import sql_target
from gateway.structured.bitmask import bitmask_words, row_ids
from gateway.structured.build import build_constraint
from gateway.structured.cache import ConstraintCache
from gateway.structured.errors import SQLPolicyViolation
from gateway.structured.sql_grammar import sql_spec
from gateway.structured.sql_schema import DatabaseSchema, SQLPolicy
from gateway.structured.sql_validate import check_sql
from gateway.structured.validate import validate_sql

TABLES = {"trades": ["id", "account_id", "symbol", "qty", "price", "ts"], "accounts": ["id", "name", "region"]}
DB = DatabaseSchema.from_mapping(TABLES)


def _recheck(sql: str, policy: SQLPolicy) -> str:
    out = check_sql(sql, DB, policy).sql
    assert check_sql(out, DB, policy).sql == out  # passes again, and the rewrite is a fixed point
    return out


@pytest.mark.parametrize("dialect", ["sqlite", "postgres"])
@pytest.mark.parametrize("sql", [
    "SELECT SUBSTR(NULL OR SIGN(qty), 1) FROM trades",  # the request the issue found (SQLite), shortened
    "SELECT SUBSTR(symbol = 'a', qty > 1) FROM trades",
    "SELECT SUBSTR(NOT symbol LIKE 'a%') FROM trades",
    "SELECT SUBSTR(symbol, qty = 1 AND id > 0) FROM trades",
    "SELECT GROUP_CONCAT((7 = 0 + SUBSTR(NULL OR SIGN('x') - CEILING(-'')))) FROM trades",
])
def test_predicate_argument_survives_the_rewrite(dialect, sql):
    """A predicate as a call's argument is written back in parentheses, which every call reads back."""
    if dialect == "postgres":
        sql = sql.replace("GROUP_CONCAT", "STRING_AGG").replace("))) FROM", ")), ',') FROM")
    try:
        check_sql(sql, DB, SQLPolicy(dialect=dialect))
    except SQLPolicyViolation as e:
        pytest.skip(f"not a {dialect} query the check admits: {e}")
    _recheck(sql, SQLPolicy(dialect=dialect))


def test_gateway_call_and_a_fresh_check_agree():
    """The gateway's call (plan.sql_target's schema and policy, validate_sql) and the public entry point with its
    defaults (dialect sqlite, LIMIT 1000) return the same text, and that text validates again."""
    from types import SimpleNamespace

    fmt = SimpleNamespace(tables=TABLES, dialect=None, database=None)
    db, policy = sql_target(fmt, SimpleNamespace(sql={}, tenant_id="dev"))
    assert policy == SQLPolicy()
    sql = "SELECT SUBSTR(symbol = 'a' OR qty > 1) FROM trades"
    returned = validate_sql(sql, db, policy).sql
    assert returned == check_sql(sql, DB).sql
    assert check_sql(returned, DB).sql == returned


def test_target_dialect_output_is_checked_in_the_target_dialect():
    """With a target dialect the rewrite is checked as that dialect's SQL (a Postgres cast written from SQLite)."""
    policy = SQLPolicy(dialect="sqlite", target_dialect="postgres")
    out = check_sql("SELECT CAST(qty AS TEXT) || symbol FROM trades", DB, policy).sql
    check_sql(out, DB, SQLPolicy(dialect="postgres"))


@pytest.mark.parametrize("dialect", ["sqlite", "postgres"])
def test_random_walk_outputs_validate_again(tokinfo, dialect):
    """Seeded random walks through grammar + guard (what the gateway's constraint admits), 40 per dialect, calls and
    predicates favoured: every output the validator accepts is returned as text the validator accepts again."""
    policy = SQLPolicy(dialect=dialect)
    spec, cache = sql_spec(DB, policy), ConstraintCache()
    texts = [tokinfo.decode([i]) for i in range(tokinfo.vocab_size)]
    favoured = np.array([t.upper().strip() in ("SUBSTR(", "SUBSTR", "(", " OR", "OR", "=", "NOT") for t in texts])
    rng = np.random.default_rng(25)
    bitmask = torch.empty(1, bitmask_words(tokinfo.vocab_size), dtype=torch.int32)
    accepted = 0
    for _ in range(40):
        c = build_constraint(spec, tokinfo, max_tokens=48, cache=cache)
        ids: list[int] = []
        for _ in range(48):
            c.advance(ids)
            c.fill_bitmask(bitmask, 0)
            allowed = row_ids(bitmask[0], tokinfo.vocab_size)
            eos = [a for a in allowed if a in c.eos_ids]
            pool = allowed[favoured[allowed]] if favoured[allowed].any() and rng.random() < 0.5 else allowed
            token = int(eos[0]) if eos and rng.random() < 0.15 else int(pool[rng.integers(len(pool))])
            ids.append(token)
            if token in c.eos_ids:
                break
        sql = tokinfo.decode([t for t in ids if t not in tokinfo.eos_ids])
        try:
            out = check_sql(sql, DB, policy).sql
        except SQLPolicyViolation:
            continue
        accepted += 1
        assert check_sql(out, DB, policy).sql == out, (sql, out)
    assert accepted >= 10

