"""Lazy verification (engine/sampler.py `first_allowed`): a constrained row's best candidates checked one by
one before its full mask pick exactly the token the full mask picks, for JSON Schema, tool calls and SQL,
greedy and seeded; top-p rows take the full mask; a token the SQL guard vetoes is never emitted.

Logits are built per step from a reference constraint's full mask: one allowed id raised, and ids the mask
forbids (first those the SQL guard vetoes after the grammar allowed them) raised above it, so the lazy path
rejects candidates before it finds one, as a trained model's near misses make it."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.sampler import RANK_GROUPS, race_noise, ranked, sample
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from gateway.structured.batch import BatchMasker
from gateway.structured.bitmask import row_ids
from gateway.structured.build import build_constraint, json_schema_spec
from gateway.structured.cache import ConstraintCache
from gateway.structured.sql_grammar import sql_spec
from gateway.structured.sql_schema import DatabaseSchema
from gateway.structured.tools import tool_call_spec

DEMO = Path(__file__).parents[3] / "engine" / "assets" / "demo-moe"
ORDER = {"type": "object", "properties": {
    "symbol": {"type": "string", "maxLength": 5}, "side": {"enum": ["buy", "sell"]},
    "quantity": {"type": "integer", "minimum": 1}, "price": {"type": "number"}},
    "required": ["symbol", "side", "quantity"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "place_order", "parameters": ORDER}}]
DB = DatabaseSchema.from_mapping({"accounts": ["id", "name", "region"],
                                  "trades": ["id", "account_id", "symbol", "qty", "price", "ts"]})
CACHE = ConstraintCache()


def _specs(tok):
    return {"json": json_schema_spec(ORDER), "tools": tool_call_spec(TOOLS, tok, "required"), "sql": sql_spec(DB)}


def _allowed(ref, words: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids the reference constraint's full mask allows, ids its grammar allows that the rest forbids)."""
    full = torch.zeros(1, words, dtype=torch.int32)
    ref.fill_bitmask(full, 0)
    allowed = row_ids(full[0])
    grammar = torch.zeros(1, words, dtype=torch.int32)
    if not ref.is_terminated():
        ref.matcher.fill_bitmask(grammar[0].data_ptr(), words)
    return allowed, np.setdiff1d(row_ids(grammar[0], ref.vocab_size), allowed)


def _decode(spec, tok, lazy: bool, temperature: float, top_p: float = 1.0, steps: int = 80, seed: int = 0):
    masker = BatchMasker(num_threads=1, prefetch=False, lazy_candidates=8 if lazy else 0)
    c = build_constraint(spec, tok, max_tokens=steps, cache=CACHE, mask_batcher=masker)
    ref = build_constraint(spec, tok, max_tokens=steps, cache=CACHE)  # the full mask of the same state
    seq = Sequence("r", [1], SamplingParams(max_tokens=steps, temperature=temperature, top_p=top_p, seed=seed,
                                            logits_processors=[c]))
    vocab, words = tok.vocab_size, c.tok_words
    for step in range(steps):
        ref.advance(seq.output_token_ids)
        allowed, vetoed = _allowed(ref, words)
        gen = torch.Generator().manual_seed(1000 * seed + step)
        logits = torch.randn(1, vocab + 24, generator=gen)  # padded lm_head rows
        logits[0, int(allowed[step * 7 % len(allowed)])] += 8.0
        forbidden = np.setdiff1d(np.arange(vocab), allowed)
        near = [*vetoed[:2].tolist(), *forbidden[torch.randint(len(forbidden), (2,), generator=gen)].tolist()]
        logits[0, near] += 9.0
        token = sample(logits, [seq], vocab)[0]
        assert isinstance(token, int), token
        assert token in allowed and token not in vetoed, (step, token, tok.decode([token]))
        seq.output_token_ids.append(token)
        if token in tok.eos_ids:
            break
    masker.close()
    return seq.output_token_ids, c


@pytest.mark.parametrize("kind", ["json", "tools", "sql"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_lazy_picks_the_full_mask_token(tokinfo, kind, temperature):
    spec = _specs(tokinfo)[kind]
    hits = 0
    for seed in range(3):
        want, full = _decode(spec, tokinfo, lazy=False, temperature=temperature, seed=seed)
        got, lazy = _decode(spec, tokinfo, lazy=True, temperature=temperature, seed=seed)
        assert got == want, (tokinfo.decode(want), tokinfo.decode(got))
        assert full.lazy_hits == full.lazy_checked == 0
        assert lazy.lazy_hits + lazy.lazy_fallbacks == len(got)  # one or the other, every step
        hits += lazy.lazy_hits
        assert lazy.lazy_checked >= lazy.lazy_hits
    assert hits > 0


def test_top_p_takes_the_full_mask_and_the_same_token(tokinfo):
    spec = _specs(tokinfo)["json"]
    want, _ = _decode(spec, tokinfo, lazy=False, temperature=0.8, top_p=0.9)
    got, lazy = _decode(spec, tokinfo, lazy=True, temperature=0.8, top_p=0.9)
    assert got == want and lazy.lazy_checked == 0


def test_a_guard_veto_is_checked_per_token(tokinfo):
    """After `... FROM trades AS t WHERE `: the grammar-allowed tokens the SQL guard vetoes (qualifiers no FROM
    binds, ...) are rejected one by one, and first_allowed passes over them to an allowed one."""
    prefix = tokinfo.encode("SELECT t.id FROM trades AS t WHERE ")
    c, ref = (build_constraint(sql_spec(DB), tokinfo, cache=CACHE) for _ in range(2))
    c.advance(prefix)
    ref.advance(prefix)
    allowed, vetoed = _allowed(ref, c.tok_words)
    assert len(vetoed), "the guard vetoes some grammar-allowed token here"
    for t in vetoed[:20].tolist():
        assert c.allows_token(t) is False, tokinfo.decode([t])
    for t in allowed[:20].tolist():
        assert c.allows_token(t) in (True, None), tokinfo.decode([t])
    pick = c.first_allowed([*vetoed[:3].tolist(), int(allowed[0])])
    assert pick == int(allowed[0]) and c.lazy_hits == 1 and c.lazy_checked == 4


def test_ranked_orders_like_greedy():
    scores = torch.tensor([1.0, 3.0, 3.0, float("-inf"), 2.0, 3.0, -1.0])
    assert list(ranked(scores, 4)) == [1, 2, 5, 4]  # ties: lowest id first, as np.argmax picks
    assert list(ranked(scores, 7)) == [1, 2, 5, 4, 0, 6]  # cut before the first -inf
    assert list(ranked(torch.tensor([0.0, float("nan"), 1.0]), 2)) == []
    assert list(ranked(torch.full((100,), float("-inf")), 4)) == []
    rows = torch.randn(50, 300, generator=torch.Generator().manual_seed(2)).round(decimals=1)  # many ties
    for row in rows:
        want = sorted(range(300), key=lambda i: (-float(row[i]), i))[:8]
        assert list(ranked(row, 8)) == want


@pytest.mark.parametrize("width", [2047, 2048, 2 * RANK_GROUPS + 5, 151_669])
def test_ranked_finds_the_top_among_grouped_ids(width):
    """Past RANK_GROUPS ids the ranking searches the best groups of ids (id mod RANK_GROUPS) only: the same ids in
    the same order as a sort of the whole row, with ties (rounded scores), mostly -inf rows, a few finite ids, and
    one score repeated across many groups (the whole row's partition then), the best ids last."""
    gen = torch.Generator().manual_seed(width)
    for case in range(24):
        row = torch.randn(width, generator=gen)
        if case % 3 == 1:
            row = row.round(decimals=1)  # many ties
        if case % 4 == 2:
            row[torch.rand(width, generator=gen) < 0.95] = float("-inf")
        if case % 6 == 3:
            row[:] = float("-inf")
            row[torch.randint(width, (case % 5,), generator=gen)] = 1.0
        if case % 8 == 5:
            row[torch.randint(width, (40,), generator=gen)] = row.max() + 1  # a tie across groups
        if case % 8 == 7:
            row[-3:] = row.max() + 2  # the best ids last (past the last whole group where width % RANK_GROUPS)
        k = 1 + case % 8
        assert list(ranked(row, k)) == _ranked_by_sorting(row.numpy(), k), case


def _ranked_by_sorting(s: np.ndarray, k: int) -> list[int]:
    """`ranked` from a sort of the whole row: greedy's pick, then (unless more than 4k ids tie within the first
    k) the next ids by score, ties lowest id first, cut at the first non-finite score."""
    if not math.isfinite(s.max()):
        return []
    top = np.sort(s)[-k]
    order = sorted(np.flatnonzero(s >= top).tolist(), key=lambda i: (-s[i], i))
    if len(order) > 4 * k:
        return order[:1]
    cut = next((j for j, t in enumerate(order[:k]) if not math.isfinite(s[t])), k)
    return order[:cut]


def test_race_sampling_follows_softmax_and_replays():
    logits = torch.tensor([[1.0, 0.2, 2.0, -1.0, 0.5, 0.0]])
    seq = Sequence("d", [1], SamplingParams(temperature=0.7, seed=3))
    n = 40000
    draws = [sample(logits.clone(), [seq])[0] for _ in range(n)]
    counts = np.bincount(draws, minlength=6)
    target = torch.softmax(logits[0] / 0.7, -1).numpy()
    chi2 = float(((counts - n * target) ** 2 / (n * target)).sum())
    assert chi2 < 25.0, (counts / n, target)  # 5 degrees of freedom: p ~ 1e-4 to fail by chance
    again = Sequence("d", [1], SamplingParams(temperature=0.7, seed=3))
    assert [sample(logits.clone(), [again])[0] for _ in range(200)] == draws[:200]
    a, b = (Sequence("d", [1], SamplingParams(temperature=0.7, seed=9)) for _ in range(2))
    first = race_noise(500, a)
    assert torch.equal(race_noise(500, b), first) and a.noise_draws == b.noise_draws == 1
    assert not torch.equal(race_noise(500, a), first)  # the next draw of the stream is another one


def test_demo_model_outputs_are_the_same_bytes_lazy_or_full():
    """The shipped demo model in execution mode (jump-forward on): JSON, tool calls and SQL, greedy and seeded,
    all in one batch: the same tokens with lazy verification as with every step's full mask."""
    from engine.experts import PlacementConfig
    from engine.llm_engine import LLM
    from gateway.structured.vocab import TokenizerInfo

    engine = LLM(DEMO, progress=False, placement=PlacementConfig(fast_format="int4", exact_format="bf16"),
                 num_kv_blocks=256, jump_forward_tokens=32).engine
    tok = TokenizerInfo.from_file(DEMO / "tokenizer.json", sorted(engine.eos_token_ids))
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "Buy 100 AAPL at market."}])
    runs, stats = {}, {}
    for lazy in (False, True):
        masker = BatchMasker(num_threads=1, prefetch=False, lazy_candidates=8 if lazy else 0)
        cons = {}
        for kind, spec in _specs(tok).items():
            for temp in (0.0, 0.7):
                cons[f"{kind}-{temp}"] = build_constraint(spec, tok, max_tokens=64, cache=CACHE, mask_batcher=masker)
                engine.add_request(f"{lazy}-{kind}-{temp}", prompt, SamplingParams(
                    max_tokens=64, temperature=temp, seed=4, logits_processors=[cons[f"{kind}-{temp}"]]),
                    mode="execution")
        done = {}
        while engine.has_work():
            done.update({o.request_id.split("-", 1)[1]: o.token_ids for o in engine.step() if o.finished})
        masker.close()
        runs[lazy], stats[lazy] = done, {k: (c.lazy_hits, c.is_accepting()) for k, c in cons.items()}
    assert runs[True] == runs[False]
    assert all(ok for _, ok in stats[True].values()), stats[True]
    assert sum(h for h, _ in stats[True].values()) > 0 and sum(h for h, _ in stats[False].values()) == 0


def test_lazy_counts_reach_the_batcher_and_metrics(tokinfo):
    from gateway.metrics import Metrics
    from gateway.structured.batch import default_masker

    masker = default_masker()
    before = dict(masker.lazy_totals)
    c = build_constraint(_specs(tokinfo)["json"], tokinfo, cache=CACHE, mask_batcher=masker)
    c.advance(tokinfo.encode('{"symbol":"AAPL","side":"buy","quantity":'))  # a number: no bytes forced
    one = tokinfo.encode("1")[0]
    assert c.first_allowed([tokinfo.encode("x")[0], one]) == one and c.first_allowed([]) is None
    assert (c.lazy_hits, c.lazy_checked, c.lazy_fallbacks) == (1, 2, 1)
    after = masker.lazy_totals
    assert [after[k] - before[k] for k in ("hits", "candidates_checked", "fallbacks")] == [1, 2, 1]
    text = Metrics().render().decode()
    assert f'moegate_constrained_lazy_steps{{counter="hits"}} {float(after["hits"])}' in text


TEXTS = {"json": '{"symbol":"AAPL","side":"buy","quantity":100,"price":1.5}',
         "tools": '<tool_call>\n{"name": "place_order", "arguments": {"symbol": "AAPL", "side": "buy", "quantity": 9}}',
         "sql": "SELECT t.symbol, a.name FROM trades AS t JOIN accounts AS a ON t.account_id = a.id WHERE t.qty > 10"}


@pytest.mark.parametrize("kind", ["json", "tools", "sql"])
@pytest.mark.parametrize("left", [None, 3])
def test_allows_token_agrees_with_the_full_mask_on_every_token(tokinfo, kind, left):
    """Along an output, every id of the vocabulary: allows_token True only for ids the full mask allows, False
    only for ids it forbids (forced bytes that tokenize to no whole token answer None). `left`: a budget that
    ends `left` tokens later, inside the closing window throughout, where states with no closer allowed and no
    completion path that fits keep the row as it is outside the window, and are answered."""
    spec, ids = _specs(tokinfo)[kind], tokinfo.encode(TEXTS[kind])
    answered = open_rows = 0
    for n in range(0, len(ids), 2):
        budget = 256 if left is None else n + left
        c, ref = (build_constraint(spec, tokinfo, max_tokens=budget, cache=CACHE) for _ in range(2))
        c.advance(ids[:n])
        ref.advance(ids[:n])
        if c.error:
            break
        allowed = set(_allowed(ref, c.tok_words)[0].tolist())
        for t in range(tokinfo.vocab_size):
            verdict = c.allows_token(t)
            assert verdict is None or verdict == (t in allowed), (tokinfo.decode(ids[:n]), tokinfo.decode([t]), verdict)
            answered += verdict is not None
        open_rows += left is not None and c._closing_leaves_row()
    assert answered > tokinfo.vocab_size
    assert left is None or open_rows >= 3


SQL_FORMS = [
    "SELECT t.symbol, a.name FROM trades AS t JOIN accounts AS a ON t.account_id = a.id WHERE t.qty > 10",
    "WITH recent AS (SELECT account_id, max(ts) AS last_ts FROM trades GROUP BY account_id) "
    "SELECT a.name, r.last_ts FROM accounts AS a JOIN recent AS r ON a.id = r.account_id",
    "SELECT T1.symbol FROM (SELECT symbol, count(*) AS n FROM trades GROUP BY symbol) AS T1 ORDER BY T1.n DESC",
    "SELECT symbol, sum(qty) AS n FROM trades WHERE name = 'it''s' GROUP BY symbol HAVING n > 10 ORDER BY 2, 1",
    "SELECT \"symbol\", count(*) FROM trades WHERE ts LIKE '2024%' AND price BETWEEN 1 AND 2 LIMIT 5",
]


@pytest.mark.parametrize("sql", SQL_FORMS)
def test_guard_keeps_agrees_with_its_filter(tokinfo, sql):
    """SQLScopeGuard.keeps (the filter's rules over a table of the candidates alone, the lazy check) against the
    whole-row filter, at every state along SQL that exercises scopes, CTEs, derived tables, strings, quoted
    names, ordinals and functions: on every grammar-allowed id at once, and one id at a time."""
    c = build_constraint(sql_spec(DB), tokinfo, cache=CACHE)
    vetoes = 0
    for token in tokinfo.encode(sql):
        grammar = torch.zeros(1, c.tok_words, dtype=torch.int32)
        c.matcher.fill_bitmask(grammar[0].data_ptr(), c.tok_words)
        ids = row_ids(grammar[0], c.vocab_size)
        row = grammar[0].numpy().view(np.uint32).copy()
        c.guard.filter(row)
        want = np.isin(ids, row_ids(row))
        assert np.array_equal(c.guard.keeps(ids), want), (sql, tokinfo.decode([token]))
        for j in range(0, len(ids), max(1, len(ids) // 50)):
            assert c.guard.keeps(ids[j:j + 1])[0] == want[j], (tokinfo.decode([int(ids[j])]), sql)
            assert c.guard.keeps_one(int(ids[j])) is bool(want[j]), (tokinfo.decode([int(ids[j])]), sql)
        vetoes += int((~want).sum())
        assert c.consume(token)
    assert vetoes, "the guard vetoed some grammar-allowed token along the way"


def test_number_guard_keeps_agrees_with_its_filter(tokinfo):
    """FiniteNumberGuard.keeps against its whole-row filter inside and outside numbers, near the exponent limit."""
    spec = json_schema_spec({"type": "object", "properties": {"x": {"type": "number"}, "s": {"type": "string"}}})
    c = build_constraint(spec, tokinfo, cache=CACHE)
    every = np.arange(tokinfo.vocab_size, dtype=np.int64)
    checked = vetoes = 0
    for token in tokinfo.encode('{"x":123456789012e295,"s":"1e999"}'):
        row = np.full(c.tok_words, 0xFFFFFFFF, dtype=np.uint32)
        c.guard.filter(row)
        want = np.isin(every, row_ids(row))
        assert np.array_equal(c.guard.keeps(every), want)
        # one token at a time, as the lazy checks ask (those without a digit answered without the search)
        for t in [*range(0, tokinfo.vocab_size, 97), *np.flatnonzero(~want).tolist()[:50]]:
            assert c.guard.keeps(np.array([t], dtype=np.int64))[0] == want[t], (token, t)
        # keeps_one (the lazy check's question) on every id: digit-free ones, candidates kept and vetoed
        assert [c.guard.keeps_one(t) for t in range(tokinfo.vocab_size)] == want.tolist(), token
        checked, vetoes = checked + 1, vetoes + int((~want).sum())
        assert c.consume(token)
    assert checked > 10 and vetoes


@pytest.mark.parametrize("sql", SQL_FORMS[:3])
def test_eos_beside_a_guard_is_ruled_on_where_the_row_keeps_a_token(tokinfo, sql):
    """At the end of a complete SQL statement EOS is answered without the full mask (";" or a space survives the
    guard, so the row is no dead end) and agrees with it; half way an answer, if any, is the full mask's; once
    ended, only EOS."""
    ids = tokinfo.encode(sql)
    for n in (len(ids) // 2, len(ids)):
        c, ref = (build_constraint(sql_spec(DB), tokinfo, cache=CACHE) for _ in range(2))
        c.advance(ids[:n])
        ref.advance(ids[:n])
        allowed = set(_allowed(ref, c.tok_words)[0].tolist())
        for eos in tokinfo.eos_ids:
            verdict = c.allows_token(eos)
            assert verdict is (eos in allowed) if n == len(ids) else verdict in (None, eos in allowed)
            assert (eos in allowed) is (n == len(ids))
    c.advance([*ids, tokinfo.eos_ids[0]])
    assert c.is_terminated() and c.allows_token(tokinfo.eos_ids[1]) is True and c.allows_token(ids[0]) is False


@pytest.mark.parametrize("kind", ["json", "tools", "sql"])
def test_forced_tokens_kept_per_state_follow_the_matcher(tokinfo, kind):
    """The matcher keeps a state's forced tokens until it consumes: along an output, one matcher's answers (asked
    twice in each state) equal a fresh copy's compute_ff_bytes / compute_ff_tokens of the same state."""
    spec, ids = _specs(tokinfo)[kind], tokinfo.encode(TEXTS[kind])
    c = build_constraint(spec, tokinfo, max_tokens=256, cache=CACHE)
    forced = 0
    for token in ids:
        fresh = c.matcher.llg.deep_copy()
        want = fresh.compute_ff_tokens()
        for _ in range(2):
            assert c.matcher.forced_token() == (want[0] if want else None)
            assert c.matcher.forces() is bool(fresh.compute_ff_bytes())
        forced += bool(want)
        assert c.consume(token)
    assert forced >= 3 or kind == "sql"  # (SQL forces no whole token along this text: the answers are None)


class _Counting:
    """An llguidance matcher that counts its forced-bytes and forced-tokens queries."""

    def __init__(self, llg) -> None:
        self.llg, self.calls = llg, {"compute_ff_bytes": 0, "compute_ff_tokens": 0}

    def __getattr__(self, name):
        if name in self.calls:
            self.calls[name] += 1
        return getattr(self.llg, name)


@pytest.mark.parametrize("kind", ["json", "tools", "sql"])
def test_a_state_is_asked_for_its_forced_bytes_once(tokinfo, kind):
    """The lazy checks and jump-forward ask `forces` and `forced_token` many times per state: llguidance answers
    the forced bytes once per state, and the forced tokens (its tokenizing search) only where bytes are forced;
    the answers stay a fresh copy's."""
    spec, ids = _specs(tokinfo)[kind], tokinfo.encode(TEXTS[kind])
    c = build_constraint(spec, tokinfo, max_tokens=256, cache=CACHE)
    counting = c.matcher.llg = _Counting(c.matcher.llg)
    unforced = 0
    for token in ids:
        fresh = counting.llg.deep_copy()
        before = dict(counting.calls)
        for _ in range(3):
            assert c.matcher.forces() is bool(fresh.compute_ff_bytes())
            assert c.matcher.forced_token() == next(iter(fresh.compute_ff_tokens()), None)
            c.allows_token(token)
            c.may_force()
        asked = {k: counting.calls[k] - before[k] for k in before}
        assert asked["compute_ff_bytes"] <= 1 and asked["compute_ff_tokens"] <= 1, (tokinfo.decode([token]), asked)
        if not fresh.compute_ff_bytes():
            assert asked["compute_ff_tokens"] == 0, tokinfo.decode([token])
            unforced += 1
        assert c.consume(token)
    assert unforced >= 3


@pytest.mark.parametrize("kind", ["json", "tools"])
def test_forced_bytes_are_answered_by_their_first_canonical_token(tokinfo, kind):
    """Where the grammar forces bytes that tokenize to whole tokens (keys, enum values), allows_token answers for
    every id without the mask: the first forced token alone, as llguidance's mask has it (not the prefixes of it
    that validate_tokens takes)."""
    spec, ids = _specs(tokinfo)[kind], tokinfo.encode(TEXTS[kind])
    forced_states = 0
    for n in range(len(ids)):
        c, ref = (build_constraint(spec, tokinfo, max_tokens=256, cache=CACHE) for _ in range(2))
        c.advance(ids[:n])
        ref.advance(ids[:n])
        if c.error or not c.matcher.forces():
            continue
        first = c.matcher.llg.deep_copy().compute_ff_tokens()
        if not first:
            continue
        forced_states += 1
        allowed = set(_allowed(ref, c.tok_words)[0].tolist())
        verdicts = [c.allows_token(t) for t in range(tokinfo.vocab_size)]
        # (EOS: the guard's own rule)
        answered = [v for t, v in enumerate(verdicts) if t not in tokinfo.eos_ids]
        assert None not in answered, tokinfo.decode(ids[:n])
        assert {t for t, v in enumerate(verdicts) if v} == allowed == {first[0]}, tokinfo.decode(ids[:n])
    assert forced_states >= 3


@pytest.mark.parametrize("kind", ["json", "tools", "sql"])
def test_jump_forward_finds_the_full_mask_forced_token_without_it(tokinfo, kind):
    """BatchMasker.forced_tokens with lazy verification gives the forced token of every-step full masks at each
    state along an output, or None where only the guard forces one (it is then sampled), and finds the grammar's
    whole forced tokens without filling a mask."""
    spec, ids = _specs(tokinfo)[kind], tokinfo.encode(TEXTS[kind])
    lazy, full = (BatchMasker(num_threads=1, prefetch=False, lazy_candidates=k) for k in (8, 0))
    without_mask = 0
    for n in range(len(ids)):
        c = build_constraint(spec, tokinfo, max_tokens=256, cache=CACHE, mask_batcher=lazy)
        ref = build_constraint(spec, tokinfo, max_tokens=256, cache=CACHE, mask_batcher=full)
        token = lazy.forced_tokens([(c, ids[:n])])[0]
        expected = full.forced_tokens([(ref, ids[:n])])[0]
        assert token == expected or (token is None and not c.may_force()), tokinfo.decode(ids[:n])
        without_mask += token is not None and id(c) not in lazy._pending
    lazy.close()
    full.close()
    assert without_mask >= (3 if kind != "sql" else 0)


@pytest.mark.parametrize("kind", ["json", "tools", "sql"])
@pytest.mark.parametrize("left", [2, 6, 40])
def test_known_row_is_the_full_mask_row(tokinfo, kind, left):
    """Constraint.known_row, where it answers (an ended output, a completion plan, the closing window: `left`
    tokens of budget, 40 outside the 32-token window), is exactly the set of ids the full mask allows."""
    spec, ids = _specs(tokinfo)[kind], tokinfo.encode(TEXTS[kind])
    answered = 0
    for n in range(len(ids) + 1):
        prefix = ids[:n] + ([tokinfo.eos_ids[0]] if n == len(ids) else [])  # (the last: after EOS)
        c, ref = (build_constraint(spec, tokinfo, max_tokens=n + left, cache=CACHE) for _ in range(2))
        c.advance(prefix)
        ref.advance(prefix)
        if c.error:
            break
        row = c.known_row()
        allowed = set(_allowed(ref, c.tok_words)[0].tolist())
        assert row is None or set(row) == allowed, (tokinfo.decode(prefix), row, sorted(allowed)[:20])
        answered += row is not None
    assert answered >= 3 or left >= 32  # (outside the window: only where a plan is committed)


@pytest.mark.parametrize("kind", ["json", "tools", "sql"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_lazy_picks_the_full_mask_token_while_closing(tokinfo, kind, temperature):
    """A budget inside the closing window throughout (completion plans, closers, EOS): lazy's tokens are the full
    mask's, and its known rows decide steps that the candidates alone could not."""
    spec = _specs(tokinfo)[kind]
    for seed in range(3):
        want, _ = _decode(spec, tokinfo, lazy=False, temperature=temperature, seed=seed, steps=24)
        got, lazy = _decode(spec, tokinfo, lazy=True, temperature=temperature, seed=seed, steps=24)
        assert got == want, (tokinfo.decode(want), tokinfo.decode(got))
        assert lazy.lazy_hits + lazy.lazy_fallbacks == len(got)
        assert kind == "tools" or lazy.lazy_hits > lazy.lazy_checked  # (a known row: a hit, no candidate checked)

