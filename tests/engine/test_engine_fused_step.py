"""The fused decode step (engine/models/fused_decode.py `FusedDecodeStep`, taken by `ModelRunner.run` for steps of
decodes only) against the forward it replaces, `ModelRunner.forward` over a ForwardBatch: the same logits bits at
every step, and the same tokens end to end, in both profiles, alone and batched, greedy and seeded."""

from __future__ import annotations

import pytest
import torch

from engine.experts import PlacementConfig
from engine.llm_engine import LLM
from engine.models.fused_decode import FusedDecodeStep
from engine.sampling_params import SamplingParams
from tests.engine.conftest import run_requests


@pytest.fixture(scope="module")
def engine(hf_checkpoint):
    ckpt = hf_checkpoint("qwen3_moe", num_experts_per_tok=4, num_hidden_layers=3, max_position_embeddings=1024)
    placement = PlacementConfig(fast_format="int4", exact_format="bf16")
    llm = LLM(ckpt, placement=placement, num_kv_blocks=128, block_size=8, fast_dense="int8", fast_lm_head="int8",
              prefix_cache=False, progress=False)
    return llm.engine


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(1, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _requests(mode: str, tag: str) -> list:
    """Four requests of different lengths (batches of 4, 3, 2 and 1 decodes), greedy and seeded."""
    def params(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True, **({"temperature": 0.8, "seed": i} if i % 2 else {}))

    return [(f"{tag}-{i}", _prompt(5 + 7 * i, i), params(i), mode) for i in range(4)]


@pytest.mark.parametrize("mode", ["exploration", "execution"])
def test_step_logits_equal_the_forward_over_a_batch(engine, mode, monkeypatch):
    """At every decode step, the fused step's logits equal, bit for bit, those of the batch forward run right after
    it on the same KV (which rewrites the step's K/V with the same bytes)."""
    runner = engine.runner
    taken, compared = [], []
    decode_step = runner._decode_step

    def checked(chunks):
        step = decode_step(chunks)
        if step is None:
            return None
        taken.append(len(chunks))

        def both(chunks, blocks):
            got, first_max = step(chunks, blocks)
            got = got.clone()
            ref = runner.forward(runner.build_batch(chunks, blocks, exact=mode == "execution"))
            compared.append(torch.equal(got, ref))
            return got, first_max

        return both

    monkeypatch.setattr(runner, "_decode_step", checked)
    run_requests(engine, _requests(mode, f"logits-{mode}"))
    assert {4, 3, 2, 1} <= set(taken)  # batched and alone
    assert compared and all(compared)


@pytest.mark.parametrize("mode", ["exploration", "execution"])
def test_tokens_equal_with_the_step_off(engine, mode, monkeypatch):
    """Greedy and seeded requests decode the same tokens with the fused step as through the batch forward."""
    fused = run_requests(engine, _requests(mode, "on"))
    with monkeypatch.context() as m:
        m.setattr(engine.runner, "_decode_step", lambda chunks: None)
        plain = run_requests(engine, _requests(mode, "off"))
    assert [fused[f"on-{i}"] for i in range(4)] == [plain[f"off-{i}"] for i in range(4)]


def test_processor_rows_get_logits_of_their_own(engine):
    """A logits processor may keep the rows it is handed: those steps' logits are not the kept buffer."""
    kept = []

    def keep(generated, row):
        kept.append(row)
        return row

    params = SamplingParams(max_tokens=6, ignore_eos=True, logits_processors=[keep])
    run_requests(engine, [("keep", _prompt(9, 3), params, "exploration")])
    decoded = kept[1:]  # after the prefill's row: the decode steps'
    assert len(decoded) == 5
    assert len({r.data_ptr() for r in decoded}) == len(decoded)
    assert all(not torch.equal(a, b) for a, b in zip(decoded, decoded[1:], strict=False))


def test_declines_what_the_batch_forward_must_run(engine):
    """Prefill chunks, drafts and deferral go through the batch forward."""
    from engine.scheduler import ScheduledChunk
    from engine.sequence import Sequence

    seq = Sequence("d", _prompt(6, 1), SamplingParams(max_tokens=4))
    seq.output_token_ids = [5]
    runner = engine.runner
    decode = ScheduledChunk(seq, 6, 1, True, 1)
    assert isinstance(runner._decode_step([decode]), FusedDecodeStep)
    assert runner._decode_step([ScheduledChunk(seq, 0, 7, True, 1)]) is None  # a prefill chunk
    assert runner._decode_step([ScheduledChunk(seq, 5, 2, True, 2)]) is None  # a token and its draft
    runner.defer = 1
    try:
        assert runner._decode_step([decode]) is None
    finally:
        runner.defer = 0


@pytest.mark.parametrize("mode", ["exploration", "execution"])
@pytest.mark.parametrize("limit", [None, 300])
def test_tokens_equal_with_the_in_kernel_pick_off(engine, mode, limit, monkeypatch):
    """The plain greedy rows' picks from the lm_head's call (`first_max`) give the tokens the sampler reads from
    the logits, batched with seeded rows, over the whole row and under a vocabulary limit (then a pick past the
    limit sends the row back to the logits)."""
    runner, used = engine.runner, []
    run = runner.run

    def counted(chunks, blocks):
        logits = run(chunks, blocks)
        used.append(runner.first_max is not None)
        return logits

    monkeypatch.setattr(runner, "run", counted)
    monkeypatch.setattr(engine, "vocab_limit", limit)
    on = run_requests(engine, _requests(mode, "pick-on"))
    assert any(used)
    used.clear()
    with monkeypatch.context() as m:
        m.setattr(FusedDecodeStep, "pick_in_kernel", False)
        off = run_requests(engine, _requests(mode, "pick-off"))
    assert not any(used)
    assert [on[f"pick-on-{i}"] for i in range(4)] == [off[f"pick-off-{i}"] for i in range(4)]


def test_kept_contexts_follow_every_table_change(engine):
    """A row that goes on from the last step writes only its new slot; a row whose sequence, table or position
    differs, or any row after a table was freed (a freed table is refilled with other blocks), its whole context.
    The contexts' buffer then holds what `blocks.slots` reads, row by row."""
    from engine.kv_cache import BlockManager

    model = engine.runner.model
    step = FusedDecodeStep(model, model.fused_layers, model.fast_lm_head.packed, 1, engine.runner.layer_caches)
    blocks = BlockManager(64, 8)
    a, b = object(), object()  # two sequences: only their identity counts
    ta, tb = [], []
    blocks.grow(ta, 40)
    blocks.grow(tb, 40)

    def write(rows):  # [(seq, table, pos)] -> each row's context as the stack reads it
        out = [(s, t, p, t[p // 8] * 8 + p % 8) for s, t, p in rows]
        longest = max(p for _, _, p in rows) + 1
        if longest > step._region or len(rows) * step._region > step._slots.shape[0] or step._stack_call is None:
            step._grow(len(rows), longest)
        step._write_contexts(out, blocks)
        ints = step._ints_np
        return [step._slots_np[ints[3, i]:ints[3, i] + ints[4, i]].tolist() for i in range(len(rows))]

    def want(rows):
        return [blocks.slots(t, 0, p + 1).tolist() for _, t, p in rows]

    for rows in ([(a, ta, 10)], [(a, ta, 11)], [(a, ta, 12), (b, tb, 3)], [(a, ta, 13), (b, tb, 4)],
                 [(b, tb, 5), (a, ta, 14)]):
        assert write(rows) == want(rows)
    blocks.free(ta)  # `a` recomputed into other blocks: its table is the same list, refilled
    blocks.grow(tb, 302)
    blocks.grow(ta, 40)
    for rows in ([(b, tb, 6), (a, ta, 15)], [(b, tb, 7), (a, ta, 16)], [(b, tb, 8)], [(b, tb, 300)], [(b, tb, 301)]):
        assert write(rows) == want(rows)
