"""Continuous batching gives each request the tokens it gets alone; KV blocks are never leaked."""

from __future__ import annotations

import torch

from engine.llm_engine import LLM
from engine.sampling_params import SamplingParams

LENGTHS = [3, 9, 17, 30, 5, 12, 1, 25]


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, 500, (n,), generator=g).tolist() for n in LENGTHS]


def test_eight_prompts_together_equal_each_alone(hf_checkpoint):
    llm = LLM(hf_checkpoint("qwen3_moe"), num_kv_blocks=128, block_size=4,
              max_num_batched_tokens=24, progress=False)  # small budget: prefills are chunked
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    together = llm.generate(_prompts(), params)
    alone = [llm.generate([p], params)[0] for p in _prompts()]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert llm.engine.blocks.num_free == 128


def test_preemption_recomputes_and_leaks_nothing(hf_checkpoint):
    path = hf_checkpoint("qwen2_moe")
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    roomy = LLM(path, num_kv_blocks=256, block_size=4, progress=False)
    expected = [o.token_ids for o in roomy.generate(_prompts(), params)]
    tight = LLM(path, num_kv_blocks=24, block_size=4, progress=False)  # 96 slots for ~260 tokens
    outs = tight.generate(_prompts(), params)
    assert [o.token_ids for o in outs] == expected
    assert tight.engine.blocks.num_free == 24
    assert not tight.engine.scheduler.running and not tight.engine.scheduler.waiting


def test_preemption_happens_under_pressure(hf_checkpoint):
    llm = LLM(hf_checkpoint("qwen3_moe"), num_kv_blocks=24, block_size=4, progress=False)
    engine = llm.engine
    for i, p in enumerate(_prompts()):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=20, ignore_eos=True))
    seqs = list(engine._seqs.values())
    while engine.has_work():
        engine.step()
        used = 24 - engine.blocks.num_free
        assert used == sum(len(s.block_table) for s in engine.scheduler.running)
    assert sum(s.num_preemptions for s in seqs) > 0
    assert all(len(s.output_token_ids) == 20 for s in seqs)
    assert engine.blocks.num_free == 24


def test_abort_frees_blocks_mid_generation(hf_checkpoint):
    llm = LLM(hf_checkpoint("mixtral"), num_kv_blocks=64, block_size=4, progress=False)
    engine = llm.engine
    for i, p in enumerate(_prompts()):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(4):
        engine.step()
    out = engine.abort("r3")
    assert out is not None and out.finished and out.finish_reason == "abort"
    assert engine.abort("r3") is None  # second abort is a no-op
    engine.abort("r0")
    engine.abort("r7")  # may still be waiting
    while engine.has_work():
        engine.step()
    assert engine.blocks.num_free == 64
    assert engine.active_request_ids() == []


def test_stop_strings_and_stop_token_ids(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("qwen3_moe"), num_kv_blocks=64, block_size=8, progress=False)
    prompt = "Portfolio summary:"
    free = llm.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 24
    stop = free.text[len(free.text) // 2 : len(free.text) // 2 + 3]
    cut = llm.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and stop not in cut.text
    assert free.text.startswith(cut.text) and free.text[len(cut.text):].startswith(stop)
    by_id = llm.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True,
                                                  stop_token_ids=[free.token_ids[5]]))[0]
    first = free.token_ids.index(free.token_ids[5])
    assert by_id.finish_reason == "stop" and by_id.token_ids == free.token_ids[: first + 1]


def test_one_failing_request_does_not_fail_its_batch(hf_checkpoint):
    llm = LLM(hf_checkpoint("qwen3_moe"), num_kv_blocks=64, block_size=4, progress=False)
    engine = llm.engine

    def breaks_at_third(generated, row):
        if len(generated) == 2:
            raise ValueError("grammar exhausted")
        return row

    engine.add_request("ok", _prompts()[0], SamplingParams(max_tokens=6, ignore_eos=True))
    engine.add_request("bad", _prompts()[1], SamplingParams(max_tokens=6, ignore_eos=True,
                                                            logits_processors=[breaks_at_third]))
    final = {}
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert final["bad"].finish_reason == "error" and "grammar exhausted" in final["bad"].error
    assert len(final["bad"].token_ids) == 2
    assert final["ok"].finish_reason == "length" and len(final["ok"].token_ids) == 6
    assert engine.blocks.num_free == 64


def test_an_output_keeps_what_it_reported_while_the_sequence_goes_on(tiny_checkpoint):
    """RequestOutput reads token_ids and text from the sequence without copying them each step: an earlier output
    still reports the tokens and text it stood at, each a prefix of the final ones."""
    llm = LLM(tiny_checkpoint("qwen3_moe"), num_kv_blocks=64, block_size=8, progress=False)
    engine = llm.engine
    engine.add_request("r", llm.tokenizer.encode("Portfolio summary:"), SamplingParams(max_tokens=12, ignore_eos=True))
    outs = []
    while engine.has_work():
        outs.extend(engine.step())
    final = outs[-1]
    assert final.finished and len(final.token_ids) == 12
    ids, text = [], ""
    for out in outs:
        ids += out.new_token_ids
        text += out.new_text
        assert out.token_ids == ids and out.text == text
        assert final.token_ids[: len(ids)] == ids and final.text.startswith(text)
    assert [len(o.token_ids) for o in outs] == list(range(1, 13))


def test_a_batch_holds_each_chunk_s_tokens_positions_and_slots(tiny_checkpoint):
    """ModelRunner.build_batch: a prefill chunk and decodes together, then a decode alone and another mix (the
    runner's token buffer reused): ids, positions, KV slots and logits rows of every row, as the slot formula
    gives them."""
    from engine.scheduler import ScheduledChunk
    from engine.sequence import Sequence

    engine = LLM(tiny_checkpoint("qwen3_moe"), num_kv_blocks=64, block_size=4, progress=False).engine
    blocks, runner = engine.blocks, engine.runner
    seqs = [Sequence(f"s{i}", list(range(1, n + 1)), SamplingParams()) for i, n in enumerate((9, 3, 6))]
    for s, done in zip(seqs, (0, 3, 6), strict=True):
        s.output_token_ids = [100 + i for i in range(done)]
        s.num_computed = s.num_tokens - 1 if done else 4
        blocks.grow(s.block_table, s.num_tokens)

    def check(chunks):
        batch = runner.build_batch(chunks, blocks)
        ids, pos, slots, rows = [], [], [], []
        for c in chunks:
            span = range(c.start, c.start + c.num_tokens)
            ids += [c.seq.token_ids[p] for p in span]
            pos += list(span)
            slots += [c.seq.block_table[p // 4] * 4 + p % 4 for p in span]
            rows += range(len(ids) - c.num_logits, len(ids))
        assert batch.input_ids.tolist() == ids and batch.positions.tolist() == pos
        assert batch.slot_mapping.tolist() == slots and batch.logits_rows.tolist() == rows
        assert batch.context_lens == [c.start + c.num_tokens for c in chunks]

    check([ScheduledChunk.of(seqs[0], 3), ScheduledChunk.of(seqs[1], 1), ScheduledChunk.of(seqs[2], 1)])
    check([ScheduledChunk.of(seqs[2], 1)])
    check([ScheduledChunk.of(seqs[0], 5), ScheduledChunk.of(seqs[1], 1)])
