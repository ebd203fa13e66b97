"""Random walks through the SQL constraint (grammar mask + scope guard) over a real tokenizer: every
finished walk must be one statement that sqlglot parses and the validator accepts.

A walk picks uniformly among the allowed tokens; with probability `sqlish` only among those whose
words are keywords, functions, the schema's names or short aliases and that do not glue onto the word
before (so walks also look like queries and finish, not only like identifier soup); EOS is taken with
probability 0.3 whenever it is allowed.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from gateway.structured.bitmask import bitmask_words, row_ids
from gateway.structured.build import build_constraint
from gateway.structured.cache import ConstraintCache
from gateway.structured.errors import StructuredOutputError
from gateway.structured.sql_grammar import _KEYWORDS, sql_spec
from gateway.structured.sql_schema import DatabaseSchema, SQLPolicy
from gateway.structured.sql_validate import check_sql
from gateway.structured.vocab import TokenizerInfo

_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ALIASES = ("t1", "t2", "a", "b", "x", "r", "n", "total")


@dataclass
class WalkReport:
    dialect: str
    walks: int = 0
    finished: int = 0
    valid: int = 0
    dead_ends: int = 0  # walks ended by a guard dead end (reported invalid, never emitted as valid)
    failures: Counter = field(default_factory=Counter)
    examples: list = field(default_factory=list)  # (sql, error) of finished walks the validator refused
    mask_us: list = field(default_factory=list)  # per step: grammar fill + guard filter
    unfinished: list = field(default_factory=list)  # (text, error) of walks that did not end

    def summary(self) -> dict:
        us = sorted(self.mask_us) or [float("nan")]
        return {"dialect": self.dialect, "walks": self.walks, "finished": self.finished, "valid": self.valid,
                "invalid": self.finished - self.valid, "dead_ends": self.dead_ends,
                "failures": dict(self.failures), "examples": self.examples[:5],
                "unfinished_examples": [(t[-160:], e) for t, e in self.unfinished[:5]],
                "mask_us_p50": us[len(us) // 2], "mask_us_mean": float(np.mean(us)),
                "mask_us_p99": us[min(len(us) - 1, int(0.99 * len(us)))]}


def random_walks(tok: TokenizerInfo, schema: DatabaseSchema, dialect: str, walks: int, max_tokens: int = 128,
                 seed: int = 0, sqlish: float = 0.95) -> WalkReport:
    policy = SQLPolicy(dialect=dialect)
    words = set(_KEYWORDS) | set(policy.functions) | set(_ALIASES)
    words |= {w.lower() for t, cols in schema.tables.items() for n in (t, *cols) for w in _WORD.findall(n)}
    texts = [(b or b"").decode("latin-1") for b in tok.token_bytes[: tok.vocab_size]]
    known = np.array([all(w.lower() in words for w in _WORD.findall(t)) for t in texts])
    glues = np.array([bool(t) and (t[0].isalnum() or t[0] == "_") for t in texts])
    spec, cache = sql_spec(schema, policy), ConstraintCache()
    rng = np.random.default_rng(seed)
    report = WalkReport(dialect)
    bitmask = torch.empty(1, bitmask_words(tok.vocab_size), dtype=torch.int32)
    for _ in range(walks):
        c = build_constraint(spec, tok, max_tokens=max_tokens, cache=cache)
        ids: list[int] = []
        for _ in range(max_tokens):
            t0 = time.perf_counter()
            c.advance(ids)
            c.fill_bitmask(bitmask, 0)
            report.mask_us.append((time.perf_counter() - t0) * 1e6)
            allowed = row_ids(bitmask[0], tok.vocab_size)
            eos = [a for a in allowed if a in c.eos_ids]
            last = texts[ids[-1]][-1:] if ids and ids[-1] < len(texts) else " "
            good = known[allowed] & ~(glues[allowed] & (last.isalnum() or last == "_"))
            pool = allowed[good] if good.any() and rng.random() < sqlish else allowed
            token = int(eos[0]) if eos and rng.random() < 0.3 else int(pool[rng.integers(len(pool))])
            ids.append(token)
            if token in c.eos_ids:
                break
        c.advance(ids)
        report.walks += 1
        report.dead_ends += c.guard_fallbacks > 0
        if not (ids and ids[-1] in c.eos_ids and c.is_accepting()):
            report.unfinished.append((tok.decode(ids), c.error))
            continue
        report.finished += 1
        sql = tok.decode(ids[:-1])
        try:
            check_sql(sql, schema, SQLPolicy(dialect=dialect, max_limit=None))
            report.valid += 1
        except StructuredOutputError as e:
            report.failures[getattr(e, "rule", type(e).__name__)] += 1
            report.examples.append((sql, str(e)[:200]))
    return report
