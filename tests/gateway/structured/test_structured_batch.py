"""Batched masks equal per-row masks; bitmask apply matches a plain reference; LRU and backends."""

from __future__ import annotations

import json

import pytest
import torch

from gateway.structured.base import ConstraintKind, ConstraintSpec
from gateway.structured.batch import BatchMasker
from gateway.structured.bitmask import _apply_by_table, apply_bitmask_, bitmask_words, row_ids
from gateway.structured.build import build_constraint, json_schema_spec, regex_spec
from gateway.structured.cache import CompileConfig, ConstraintCache
from gateway.structured.constraint import Constraint
from kernels.fused_moe import kernel_available


def _reference(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    ref = logits.clone()
    for b in range(logits.shape[0]):
        allowed = torch.zeros(logits.shape[1], dtype=torch.bool)
        allowed[torch.as_tensor(row_ids(bitmask[b], logits.shape[1]), dtype=torch.long)] = True
        ref[b][~allowed] = float("-inf")
    return ref


@pytest.mark.parametrize("path", ["compiled", "table"])
@pytest.mark.parametrize("vocab", [1000, 1001, 32 * 7])
def test_apply_matches_reference(path, vocab):
    """Random words plus whole-word cases (all allowed, none allowed), rows with a stride (a slice
    of a wider logits tensor, a padded bitmask), through the compiled kernel and the portable table."""
    torch.manual_seed(vocab)
    words = bitmask_words(vocab) + 2  # padded mask rows
    bitmask = torch.randint(-(2**31), 2**31 - 1, (4, words), dtype=torch.int32)
    bitmask[1, ::3] = -1
    bitmask[1, 1::3] = 0
    bitmask[2] = -1
    bitmask[3] = 0
    bitmask[3, 5] = 1 << 4  # exactly one id: 5 * 32 + 4
    wide = torch.randn(4, vocab + 7)
    logits = wide[:, :vocab]  # [4, V], row stride V + 7
    ref = _reference(logits, bitmask)
    if path == "compiled":
        if not kernel_available():
            pytest.skip("the compiled kernel library is not available")
        apply_bitmask_(logits, bitmask)
    else:
        _apply_by_table(logits, bitmask)
    assert torch.equal(logits, ref)
    assert torch.equal(logits[2], ref[2]) and int(torch.isfinite(logits[3]).sum()) == 1


def test_batched_fill_equals_rowwise_and_async(tokinfo):
    cache = ConstraintCache()
    specs = [json_schema_spec({"type": "object", "properties": {"a": {"type": "integer"}}}),
             regex_spec("[0-9]{3}-[A-Z]{2}"),
             ConstraintSpec(ConstraintKind.GRAMMAR, 'start: "yes" | "no"\n')]
    cons = [build_constraint(s, tokinfo, cache=cache) for s in specs]
    cons[0].advance(tokinfo.encode('{"a":'))
    batch = [cons[0], None, cons[1], cons[2]]
    vocab = tokinfo.vocab_size + 50  # padded logits
    masker = BatchMasker(num_threads=2)
    got = torch.zeros(4, bitmask_words(vocab), dtype=torch.int32)
    masker.fill_async(batch, got).result()
    for b, c in enumerate(batch):
        want = torch.zeros(1, bitmask_words(vocab), dtype=torch.int32)
        if c is None:
            want.fill_(-1)
        else:
            c.fill_bitmask(want, 0)
        assert torch.equal(got[b], want[0]), b
    logits = torch.zeros(4, vocab)
    masker.apply(logits, got)
    assert torch.isfinite(logits[1]).all()
    assert torch.isfinite(logits[0, tokinfo.vocab_size:]).sum() == 0
    masker.close()


@pytest.mark.parametrize("lazy", [0, 8])
def test_batched_forced_tokens_equal_per_constraint(tokinfo, lazy):
    """BatchMasker.forced_tokens (one fill for every stale row) gives each constraint's forced_token, walking
    several constraints to their ends together; the masks it keeps serve the next `masks` call (with lazy
    verification the rows known without a mask, e.g. ended ones, keep none)."""
    cache = ConstraintCache()
    schema = {"type": "object", "properties": {"side": {"enum": ["buy", "sell"]}, "qty": {"type": "integer"}},
              "required": ["side", "qty"], "additionalProperties": False}
    specs = [json_schema_spec(schema), regex_spec("ORD-[0-9]{2}-(buy|sell)"), json_schema_spec({"enum": ["alpha"]})]
    masker = BatchMasker(num_threads=2, prefetch=False, lazy_candidates=lazy)
    batched = [build_constraint(s, tokinfo, cache=cache, mask_batcher=masker) for s in specs]
    alone = [build_constraint(s, tokinfo, cache=cache) for s in specs]
    ids: list[list[int]] = [[], [], []]
    forced_any = False
    for _ in range(40):
        got = masker.forced_tokens([(c, i) for c, i in zip(batched, ids, strict=True)])
        want = [c.forced_token(i) for c, i in zip(alone, ids, strict=True)]
        assert got == want
        forced_any |= any(t is not None for t in got)
        words = bitmask_words(tokinfo.vocab_size)
        kept = masker.masks(batched, words)  # from the rows forced_tokens filled
        for row, c in zip(kept, alone, strict=True):
            ref = torch.zeros(1, words, dtype=torch.int32)
            c.fill_bitmask(ref, 0)
            assert torch.equal(row, ref[0])
        for i, t in enumerate(got):  # forced, else the first allowed id
            ids[i].append(t if t is not None else int(row_ids(kept[i], tokinfo.vocab_size)[0]))
        if all(c.is_terminated() or c.is_accepting() for c in alone):
            break
    assert forced_any and (lazy or masker.prefetch_hits > 0)
    masker.close()


def test_forced_tokens_fill_rows_wide_enough_after_a_narrower_model(tokinfo):
    """The process-wide masker may last have masked another model's logits, of a smaller vocabulary: forced_tokens
    then fills rows as wide as its constraints need (it failed with "bitmask has N words per row")."""
    masker = BatchMasker(num_threads=2, prefetch=False, lazy_candidates=0)  # every row's mask filled
    masker.masks([], 2)  # a narrow model's step
    schema = {"type": "object", "properties": {"side": {"enum": ["buy", "sell"]}}, "required": ["side"],
              "additionalProperties": False}
    c = build_constraint(json_schema_spec(schema), tokinfo, cache=ConstraintCache(), mask_batcher=masker)
    alone = build_constraint(json_schema_spec(schema), tokinfo, cache=ConstraintCache())
    assert masker.forced_tokens([(c, [])]) == [alone.forced_token([])]
    masker.close()


def test_lru_evicts_and_keys_by_tokenizer(tokinfo):
    cache = ConstraintCache(CompileConfig(cache_entries=2))
    a, b, c = (regex_spec(p) for p in ("a+", "b+", "c+"))
    first = cache.get_or_compile(a, tokinfo)
    assert cache.get_or_compile(a, tokinfo) is first
    cache.get_or_compile(b, tokinfo)
    cache.get_or_compile(c, tokinfo)  # evicts a (least recently used)
    assert len(cache) == 2 and cache.get_or_compile(a, tokinfo) is not first


def ids_token_in(token, masks):
    return all(token in m for m in masks)


def test_outlines_and_llguidance_agree_on_a_regex(tokinfo):
    spec = regex_spec("(buy|sell) [0-9]{1,3}")
    cache = ConstraintCache()
    ll = build_constraint(spec, tokinfo, cache=cache)
    oc = build_constraint(spec, tokinfo, backend="outlines-core", cache=cache)
    ids: list[int] = []
    for token in tokinfo.encode("sell 42"):
        masks = []
        for c in (ll, oc):
            m = torch.zeros(1, bitmask_words(tokinfo.vocab_size), dtype=torch.int32)
            c.advance(ids)
            c.fill_bitmask(m, 0)
            masks.append(set(row_ids(m[0]).tolist()))
        # same language; llguidance may drop non-canonical splits (e.g. 's' when 'sell' fits)
        assert masks[0] and masks[0] <= masks[1] and ids_token_in(token, masks)
        ids.append(token)
    for c in (ll, oc):
        c.advance(ids)
        assert c.is_accepting()


def test_logits_processor_contract(tokinfo):
    compiled = ConstraintCache().get_or_compile(
        ConstraintSpec(ConstraintKind.JSON_SCHEMA, json.dumps({"enum": ["ok"]})), tokinfo)
    c = Constraint(compiled)
    row = torch.zeros(tokinfo.vocab_size + 7)
    out = c([], row)
    assert out.shape == row.shape and torch.isfinite(out).sum() >= 1
