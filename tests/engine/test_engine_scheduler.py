"""Block manager and scheduler logic, without a model."""

from __future__ import annotations

import pytest

from engine.kv_cache import BlockManager, OutOfBlocks
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import SeqStatus, Sequence


def _seq(rid: str, n: int, max_tokens: int = 8) -> Sequence:
    return Sequence(rid, list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens))


def _run_step(sched: Scheduler):
    """Pretend the model ran: mark chunks computed and append a token where one is sampled."""
    chunks = sched.schedule()
    for c in chunks:
        c.seq.num_computed = c.start + c.num_tokens
        if c.samples:
            c.seq.output_token_ids.append(7)
    return chunks


def test_block_manager_refcounts_and_double_free():
    bm = BlockManager(4, 16)
    table: list[int] = []
    bm.grow(table, 33)
    assert len(table) == 3 and bm.num_free == 1
    bm.share(table[0])
    other = [table[0]]
    bm.free(table)
    assert bm.num_free == 3  # the shared block stays allocated
    bm.free(other)
    assert bm.num_free == 4
    with pytest.raises(ValueError, match="double free"):
        bm.free([0])
    with pytest.raises(OutOfBlocks):
        bm.grow([], 16 * 5)


def test_chunked_prefill_respects_token_budget():
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=10), BlockManager(64, 4))
    a, b = _seq("a", 25), _seq("b", 3)
    sched.add(a)
    sched.add(b)
    steps = []
    for _ in range(4):
        chunks = _run_step(sched)
        assert sum(c.num_tokens for c in chunks) <= 10
        steps.append([(c.seq.request_id, c.num_tokens, c.samples) for c in chunks])
    assert steps[0] == [("a", 10, False)]
    assert steps[1] == [("a", 10, False)]
    assert steps[2] == [("a", 5, True), ("b", 3, True)]  # the short request joins in the same step
    assert steps[3] == [("a", 1, True), ("b", 1, True)]  # then both decode


def test_preempts_latest_arrival_and_requeues_it_first():
    bm = BlockManager(6, 4)  # 24 slots
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), bm)
    first, second = _seq("first", 12, max_tokens=20), _seq("second", 12, max_tokens=20)
    sched.add(first)
    sched.add(second)
    _run_step(sched)  # both prefilled: 3 blocks each, pool full
    assert bm.num_free == 0
    _run_step(sched)  # first needs a 4th block for position 12: second is preempted
    assert second.status is SeqStatus.WAITING and second.num_computed == 0 and second.block_table == []
    assert second.num_preemptions == 1 and sched.waiting[0] is second
    assert first.status is SeqStatus.RUNNING


def test_finish_frees_blocks_for_waiting_and_running():
    bm = BlockManager(8, 4)
    sched = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64), bm)
    a, b = _seq("a", 5), _seq("b", 5)
    sched.add(a)
    sched.add(b)
    _run_step(sched)
    assert a.status is SeqStatus.RUNNING and b.status is SeqStatus.WAITING  # max_num_seqs=1
    sched.finish(b, "abort")
    sched.finish(a, "stop")
    assert bm.num_free == 8 and not sched.has_work()


def test_block_slots_match_the_position_formula():
    """BlockManager.slots: slot of position p = block_table[p // block_size] * block_size + p % block_size, for
    every span (empty, inside one block, across blocks, starting mid-block)."""
    import random

    import torch

    blocks, rng = BlockManager(64, 16), random.Random(0)
    for _ in range(500):
        table = rng.sample(range(64), rng.randint(1, 12))
        end = rng.randint(0, 16 * len(table))
        start = rng.randint(0, end)
        pos = torch.arange(start, end)
        want = torch.tensor(table)[pos // 16] * 16 + pos % 16
        got = blocks.slots(table, start, end)
        assert got.dtype == torch.long and torch.equal(got, want), (table, start, end)


def test_block_slots_follow_a_table_that_grows_and_is_refilled():
    """A table's slots are kept between calls (a decode step slices them): they follow the table as it grows,
    after `free` clears it and it is refilled with other blocks, and after an edit in place."""
    import torch

    blocks = BlockManager(64, 16)

    def want(table, end):
        pos = torch.arange(end)
        return torch.tensor(table)[pos // 16] * 16 + pos % 16

    table: list[int] = []
    blocks.grow(table, 20)  # two blocks
    assert torch.equal(blocks.slots(table, 0, 20), want(table, 20))
    blocks.grow(table, 40)  # a third block
    assert torch.equal(blocks.slots(table, 0, 40), want(table, 40))
    assert torch.equal(blocks.slots(table, 21, 40), want(table, 40)[21:])
    blocks.free(table)
    assert table == []
    table.extend([blocks.allocate() for _ in range(3)][::-1])  # other blocks, other order, the same list
    assert torch.equal(blocks.slots(table, 0, 33), want(table, 33))
    table[0] = 63 if table[0] != 63 else 62  # a block swapped in place
    assert torch.equal(blocks.slots(table, 0, 33), want(table, 33))
