"""The engine sampler's batched path (one BatchMasker call per step, with or without the prefetch during
the forward)
picks exactly the tokens the per-row logits-processor path picks."""

from __future__ import annotations

import pytest
import torch

from engine.sampler import sample
from engine.sampling_params import MaskProcessor, SamplingParams
from engine.sequence import Sequence
from gateway.structured.base import ConstraintKind, ConstraintSpec
from gateway.structured.batch import BatchMasker
from gateway.structured.build import build_constraint, json_schema_spec, regex_spec
from gateway.structured.cache import ConstraintCache

SPECS = [
    json_schema_spec({"type": "object", "properties": {"side": {"enum": ["buy", "sell"]}, "qty": {"type": "integer"}},
                      "required": ["side", "qty"]}),
    regex_spec("[A-Z]{3,5}-[0-9]{2}"),
    ConstraintSpec(ConstraintKind.GRAMMAR, 'start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]{1,3}/\n'),
    json_schema_spec({"type": "array", "items": {"type": "number"}, "maxItems": 3}),
]


def _run(tokinfo, batched: bool, steps: int = 24, prefetch: bool = True, lazy: int = 8):
    cache, masker = ConstraintCache(), BatchMasker(num_threads=2, prefetch=prefetch, lazy_candidates=lazy)
    cons = [build_constraint(s, tokinfo, max_tokens=steps, cache=cache, mask_batcher=masker if batched else None)
            for s in SPECS]
    # temperature rows use per-sequence seeded generators: the same draws on both paths
    seqs = [Sequence(f"r{i}", [1], SamplingParams(max_tokens=steps, temperature=0.0 if i % 2 else 0.8, seed=i,
                                                  logits_processors=[c])) for i, c in enumerate(cons)]
    gen = torch.Generator().manual_seed(0)
    vocab = tokinfo.vocab_size + 40  # padded lm_head rows
    for _ in range(steps):
        live = [s for s in seqs if not s.is_finished and len(s.output_token_ids) < steps
                and (not s.output_token_ids or s.output_token_ids[-1] not in tokinfo.eos_ids)]
        if not live:
            break
        logits = torch.randn(len(live), vocab, generator=gen)
        for seq, tok in zip(live, sample(logits, live, tokinfo.vocab_size), strict=True):
            assert isinstance(tok, int), tok
            seq.output_token_ids.append(tok)
    hits = masker.prefetch_hits
    masker.close()
    return [s.output_token_ids for s in seqs], cons, hits


@pytest.mark.parametrize("lazy", [0, 8])
@pytest.mark.parametrize("prefetch", [True, False])
def test_batched_sampler_matches_per_row(tokinfo, prefetch, lazy):
    per_row, _, _ = _run(tokinfo, batched=False)
    batched, cons, hits = _run(tokinfo, batched=True, prefetch=prefetch, lazy=lazy)
    assert batched == per_row
    assert all(isinstance(c, MaskProcessor) for c in cons)
    if prefetch and not lazy:  # (lazy: the closing window's rows, all 24 steps here, are mostly known without one)
        assert hits > len(SPECS)  # later steps were served by the prefetch started after sampling
    else:
        assert hits == 0  # every step's masks computed in the sampler, in one batched call
    for c, ids in zip(cons, batched, strict=True):
        c.advance(ids)
        assert not c.error and c.is_accepting(), (tokinfo.decode(ids), c.error)


def test_a_stale_prefetch_is_recomputed(tokinfo):
    masker = BatchMasker(num_threads=1, prefetch=True)
    c = build_constraint(regex_spec("[a-c]{2}x"), tokinfo, mask_batcher=masker)
    words = (tokinfo.vocab_size + 31) // 32
    masker.masks([c], words)
    masker.prefetch([c])
    masker.wait()
    c.advance(tokinfo.encode("ab"))  # moved after the prefetch: its row no longer applies
    fresh = masker.masks([c], words)
    assert masker.prefetch_hits == 0
    want = torch.zeros(1, words, dtype=torch.int32)
    c.fill_bitmask(want, 0)
    assert torch.equal(fresh, want)
    masker.close()
