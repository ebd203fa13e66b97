"""SQL scope guard, word check: where every qualifier must already be bound, a word that starts an
operand stays a prefix of a column in scope, a bound name, (in ORDER BY) a SELECT-list alias, a
function or an operand keyword (so it never grows into a name that could only go on as an unbound
qualifier)."""

from __future__ import annotations

import numpy as np
import torch

from evals.structured.sql_eval import scope_vetoes
from gateway.structured.bitmask import bitmask_words
from gateway.structured.cache import ConstraintCache
from gateway.structured.constraint import Constraint
from gateway.structured.sql_grammar import sql_spec
from gateway.structured.sql_guard import SQLScopeGuard
from gateway.structured.sql_schema import DatabaseSchema
from gateway.structured.sql_validate import check_sql

DB = DatabaseSchema.from_mapping({
    "accounts": ["id", "name", "region"],
    "trades": ["id", "account_id", "symbol", "qty", "price", "ts"],
    "positions": ["account_id", "symbol", "qty", "Market Value"],
})


def _allows(tokinfo, sql: str, final: bool = False) -> bool:
    guard = SQLScopeGuard.from_grammar(sql_spec(DB).source, tokinfo)
    return guard.allows(tokinfo.encode(sql), final=final)


def test_word_in_where_or_on_stays_a_prefix_of_an_allowed_word(tokinfo):
    assert _allows(tokinfo, "SELECT id FROM trades WHERE qt")
    assert not _allows(tokinfo, "SELECT id FROM trades WHERE datepattern")  # only an unbound qualifier
    assert not _allows(tokinfo, "SELECT id FROM trades WHERE qty > 1 AND zz")
    assert not _allows(tokinfo, "SELECT id FROM trades WHERE region")  # a column of a table not in scope
    # a name the grammar takes only quoted is written quoted (quoted words are not checked)
    assert not _allows(tokinfo, "SELECT symbol FROM positions WHERE market")
    assert _allows(tokinfo, 'SELECT symbol FROM positions WHERE "Market Value" > 1', final=True)
    assert _allows(tokinfo, "SELECT a.id FROM accounts AS a WHERE region = 'EU'", final=True)
    assert _allows(tokinfo, "SELECT a.id FROM accounts AS a WHERE a.id IN (SELECT account_id FROM trades "
                            "WHERE region = 'EU')", final=True)  # the outer scope's columns
    assert not _allows(tokinfo, "SELECT a.id FROM accounts AS a JOIN trades AS t ON zz")
    assert not _allows(tokinfo, "SELECT id FROM trades ORDER BY qty DESC, zz")
    # where a qualifier may still be bound by a later FROM, words are not checked
    assert _allows(tokinfo, "SELECT zz")
    assert _allows(tokinfo, "SELECT id FROM trades WHERE id IN (SELECT zz")


def _name_writer(tokinfo, prefix: list[int], seed: int):
    """A model that, after `prefix`, would rather go on writing the identifier it is in."""
    ident = torch.tensor([bool(b) and all(c < 128 and (chr(c).isalnum() or c == 95) for c in b)
                          for b in tokinfo.token_bytes[: tokinfo.vocab_size]])
    gen = torch.Generator().manual_seed(seed)

    def logits(ids: list[int]) -> torch.Tensor:
        if len(ids) < len(prefix):
            out = torch.full((tokinfo.vocab_size,), -1e4)
            out[prefix[len(ids)]] = 0.0
            return out
        return torch.randn(tokinfo.vocab_size, generator=gen) + 20.0 * ident
    return logits


def test_a_name_writing_model_never_meets_the_dead_end(tokinfo):
    """The dead end: `WHERE datepattern_id0...` grows to the 32-character limit, where only `.` may
    follow, and the guard vetoes that unbound qualifier (every token ruled out, the guard stepped
    aside). Now the word cannot leave the allowed words, so the guard never has to stand aside."""
    compiled = ConstraintCache().get_or_compile(sql_spec(DB), tokinfo)
    for where in ("SELECT id FROM trades WHERE ", "SELECT a.id FROM accounts AS a JOIN trades AS t ON ",
                  "SELECT symbol, count(*) AS cnt FROM trades GROUP BY symbol HAVING ",
                  "SELECT symbol, count(*) AS cnt FROM trades GROUP BY symbol ORDER BY "):
        prefix = tokinfo.encode(where)
        for seed in range(3):
            c = Constraint(compiled, max_tokens=64)
            logits, ids = _name_writer(tokinfo, prefix, seed), []
            for _ in range(64):
                row = logits(ids)
                c(ids, row)
                ids.append(int(torch.argmax(row)))
                if ids[-1] in c.eos_ids:
                    break
            assert c.guard_fallbacks == 0, (where, tokinfo.decode(ids))


def test_select_alias_usable_in_order_by(tokinfo):
    compiled = ConstraintCache().get_or_compile(sql_spec(DB), tokinfo)
    for sql in ["SELECT symbol, count(*) AS cnt FROM trades GROUP BY symbol ORDER BY cnt DESC LIMIT 3",
                "SELECT qty FROM trades UNION SELECT qty FROM positions ORDER BY qty"]:
        assert scope_vetoes(compiled, tokinfo.encode(sql)) is None, sql
        check_sql(sql, DB)
    assert not _allows(tokinfo, "SELECT count(*) AS cnt FROM trades ORDER BY cnx", final=True)
    # GROUP BY / HAVING / ORDER BY may name a SELECT-list alias, nothing else that is not a column in scope
    assert _allows(tokinfo, "SELECT symbol, count(*) AS cnt FROM trades GROUP BY symbol HAVING cnt > 1", final=True)
    assert not _allows(tokinfo, "SELECT symbol, count(*) AS cnt FROM trades GROUP BY symbol HAVING zz")


def test_keywords_and_functions_still_typeable(tokinfo):
    compiled = ConstraintCache().get_or_compile(sql_spec(DB), tokinfo)
    for sql in [
        "SELECT T1.name FROM accounts AS T1 JOIN trades AS T2 ON T1.id = T2.account_id WHERE T2.qty > 10 "
        "AND NOT EXISTS (SELECT * FROM positions WHERE positions.symbol = T2.symbol) ORDER BY T2.ts DESC",
        "SELECT id FROM trades WHERE price IS NOT NULL AND CAST(qty AS integer) > 1 AND symbol NOT IN ('a', 'b') "
        "AND CASE WHEN qty > 1 THEN 1 ELSE 0 END = 1",
        "SELECT id FROM trades WHERE symbol LIKE 'A%' AND qty BETWEEN 1 AND 2 OR lower(symbol) = 'x' "
        "GROUP BY id HAVING count(DISTINCT symbol) > 1 ORDER BY max(price), abs(qty)",
        "SELECT id FROM trades WHERE qty > (SELECT avg(qty) FROM trades) AND id IN (SELECT account_id FROM positions)",
    ]:
        assert scope_vetoes(compiled, tokinfo.encode(sql)) is None, sql


def test_derived_tables_are_not_checked(tokinfo):
    compiled = ConstraintCache().get_or_compile(sql_spec(DB), tokinfo)
    for sql in ["SELECT * FROM (SELECT symbol FROM trades) WHERE symbol = 'x'",
                "WITH cte_s AS (SELECT symbol FROM trades) SELECT * FROM cte_s WHERE symbol = 'x'",
                "SELECT d.symbol FROM (SELECT symbol FROM trades) AS d WHERE symbol = 'x'"]:
        assert scope_vetoes(compiled, tokinfo.encode(sql)) is None, sql


def test_filter_agrees_with_simulating_every_token(tokinfo):
    """The filter's shortcuts (prefix tests, head groups) clear the tokens that a one-by-one
    simulation vetoes, at every step of queries that pass through checked and unchecked words."""
    compiled = ConstraintCache().get_or_compile(sql_spec(DB), tokinfo)
    words = bitmask_words(tokinfo.vocab_size)
    for sql in ["SELECT T1.name, count(*) AS n FROM accounts AS T1 JOIN trades AS T2 ON T1.id = T2.account_id "
                "WHERE T2.qty > 1 AND region = 'EU' GROUP BY T1.name ORDER BY n",
                "SELECT id FROM trades WHERE symbol IN (SELECT symbol FROM positions WHERE qty < 0)",
                "SELECT t1.max_qty, symbol FROM (SELECT max(qty) AS max_qty, symbol FROM trades) AS t1 ORDER BY 2, 1"]:
        c = Constraint(compiled)
        for t in tokinfo.encode(sql):
            grammar_only = torch.zeros(1, words, dtype=torch.int32)
            guard, c.guard = c.guard, None
            c.fill_bitmask(grammar_only, 0)
            c.guard = guard
            both = torch.zeros(1, words, dtype=torch.int32)
            c.fill_bitmask(both, 0)
            allowed = np.flatnonzero(np.unpackbits(grammar_only[0].numpy().view(np.uint8), bitorder="little"))
            kept = set(np.flatnonzero(np.unpackbits(both[0].numpy().view(np.uint8), bitorder="little")).tolist())
            eos = set(c.eos_ids)
            want = {int(a) for a in allowed if a in eos or guard.allows([int(a)], final=False)}
            assert kept - eos <= want - eos, (tokinfo.decode(tokinfo.encode(sql)[: c.consumed]),
                                              [tokinfo.decode([t]) for t in sorted(kept - want)][:12])
            if guard.scope.dot_q is None:  # (after `q.` a quoted column is left out: conservative)
                assert kept - eos == want - eos, (tokinfo.decode(tokinfo.encode(sql)[: c.consumed]), want - kept)
            c.consume(t)


def test_filter_agrees_on_the_qwen_vocabulary():
    """The same on the real 151k-token Qwen vocabulary (tokens like " name", "(count", "_id")."""
    from evals.structured.qwen_vocab import QWEN_EOS_IDS, qwen_tokenizer_json
    from gateway.structured.vocab import TokenizerInfo

    tok = TokenizerInfo.from_file(str(qwen_tokenizer_json()), list(QWEN_EOS_IDS))
    compiled = ConstraintCache().get_or_compile(sql_spec(DB), tok)
    words = bitmask_words(tok.vocab_size)
    for prefix in ["SELECT T1.name FROM accounts AS T1 JOIN trades AS T2 ON T1.id =",
                   "SELECT T1.name FROM accounts AS T1 JOIN trades AS T2 ON T1.id = T2.account_id WHERE T2.qty > 1 AND",
                   "SELECT symbol, count(*) AS cnt FROM trades GROUP BY symbol ORDER BY c"]:
        c = Constraint(compiled)
        for t in tok.encode(prefix):
            c.consume(t)
        guard, c.guard = c.guard, None
        row = torch.zeros(1, words, dtype=torch.int32)
        c.fill_bitmask(row, 0)
        allowed = np.flatnonzero(np.unpackbits(row[0].numpy().view(np.uint8), bitorder="little"))
        out = row[0].numpy().view(np.uint32).copy()
        guard.filter(out)
        kept = set(np.flatnonzero(np.unpackbits(out.view(np.uint8), bitorder="little")).tolist())
        want = {int(a) for a in allowed if guard.allows([int(a)], final=False)}
        eos = set(c.eos_ids)  # (EOS is the Constraint's: allowed when the guard allows the end)
        assert kept - eos == want - eos, (prefix, [tok.decode([t]) for t in sorted(kept ^ want)[:10]])
        assert len(kept) < len(allowed) // 10  # words are checked there: most names are ruled out
