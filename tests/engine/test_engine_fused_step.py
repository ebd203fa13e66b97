"""The fused one-call step (engine/models/fused_step.py `FusedDecodeStep`, taken by `ModelRunner.run` for steps of
up to SMALL_BATCH_TOKENS tokens: decodes, jump-forward chunks, drafts, short prefill chunks) against the forward it
replaces, `ModelRunner.forward` over a ForwardBatch, and against token-by-token decoding: the same logits and KV bits
at every step, and the same tokens end to end, in both profiles, alone and batched, greedy and seeded."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.experts import PlacementConfig
from engine.llm_engine import LLM
from engine.models.fused_step import FusedDecodeStep
from engine.sampler import HeadPicks
from engine.sampling_params import SamplingParams
from kernels.race_noise import race_sample
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


def _requests(mode: str, tag: str, **sampled) -> list:
    """Four requests of different lengths (batches of 4, 3, 2 and 1 decodes), greedy and seeded (`sampled`: more
    parameters of the seeded ones)."""
    def params(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True,
                              **({"temperature": 0.8, "seed": i, **sampled} if i % 2 else {}))

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
def test_decode_rows_write_what_every_row_path_writes(engine, mode, monkeypatch):
    """A step of decodes whose contexts the last step wrote (`_decodes`: item by item through flat views) leaves the
    ids, positions, slots, contexts, RoPE and embedding rows the general path (`_inputs`) writes over them, batched
    and alone, and the races' inputs `_races` writes; the tokens then follow from
    `test_step_logits_equal_the_forward_over_a_batch`."""
    runner, taken, compared = engine.runner, [], []
    decode_step = runner._decode_step

    def inputs(step, t):
        ints = step._ints_np
        return [ints[:, :t].copy(), step._rope_np[:, :t].copy(), step._x_np[:t].copy(),
                [step.contexts.slots_np[ints[3, i]:ints[3, i] + ints[4, i]].copy() for i in range(t)]]

    def checked(chunks):
        step = decode_step(chunks)
        if step is not None and "_decodes" not in vars(step):
            decodes = step._decodes

            def both(chunks, blocks):
                for a in (step._race_call.temps, step._race_call.keys, step._race_call.counters):
                    a.fill(7)  # poisoned: the rows' race inputs are what `_decodes` writes
                rows = decodes(chunks, blocks)
                if rows is not None:
                    t = len(chunks)
                    taken.append(t)
                    got = inputs(step, t)
                    race = step._race_call
                    race_inputs = [a[:t].copy() for a in (race.temps, race.keys, race.counters)]
                    assert step._inputs(chunks, blocks) == (t, *rows[:2], True)
                    races = step._races(chunks)  # the races' inputs as the general path writes them
                    assert rows[2] == races and (races is None or all(np.array_equal(a[:t], w) for a, w in zip(
                        (race.temps, race.keys, race.counters), race_inputs, strict=True)))
                    want = inputs(step, t)
                    compared.append(all(np.array_equal(g, w) for g, w in zip(got[:3], want[:3], strict=True))
                                    and all(np.array_equal(g, w) for g, w in zip(got[3], want[3], strict=True)))
                return rows

            monkeypatch.setattr(step, "_decodes", both)
        return step

    monkeypatch.setattr(runner, "_decode_step", checked)
    run_requests(engine, _requests(mode, f"rows-{mode}"))
    assert {4, 3, 2, 1} <= set(taken)
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
    """Steps over SMALL_BATCH_TOKENS tokens, of both modes, or with deferral go through the batch forward."""
    from engine.scheduler import ScheduledChunk
    from engine.sequence import Sequence

    seq = Sequence("d", _prompt(20, 1), SamplingParams(max_tokens=4))
    other = Sequence("e", _prompt(6, 2), SamplingParams(max_tokens=4), mode="execution")
    seq.output_token_ids = [5]
    runner = engine.runner
    decode = ScheduledChunk(seq, 20, 1, True, 1)
    assert isinstance(runner._decode_step([decode]), FusedDecodeStep)
    assert isinstance(runner._decode_step([ScheduledChunk(seq, 0, 16, False, 0)]), FusedDecodeStep)  # short prefill
    assert isinstance(runner._decode_step([ScheduledChunk(seq, 19, 2, True, 2)]), FusedDecodeStep)  # token + draft
    assert runner._decode_step([ScheduledChunk(seq, 0, 17, False, 0)]) is None  # past SMALL_BATCH_TOKENS
    assert runner._decode_step([ScheduledChunk(seq, 4, 16, False, 0), decode]) is None  # 16 + 1 tokens
    assert runner._decode_step([decode, ScheduledChunk(other, 0, 6, True, 1)]) is None  # two modes
    runner.defer = 1
    try:
        assert runner._decode_step([decode]) is None
    finally:
        runner.defer = 0


def _kv(runner, blocks, chunks) -> torch.Tensor:
    """The K/V every layer holds at the chunks' new tokens' slots: [L, tensors, tokens, heads, width]."""
    slots = torch.cat([blocks.slots(c.seq.block_table, c.start, c.start + c.num_tokens) for c in chunks])
    return torch.stack([torch.stack([t[slots] for t in layer]) for layer in runner.kv_caches])


@pytest.mark.parametrize("mode", ["exploration", "execution"])
def test_mixed_chunks_equal_the_forward_and_token_by_token(engine, mode):
    """Steps that mix a decode row, jump-forward chunks (k tokens, the last samples), a token with its drafts (every
    row samples) and short prefill chunks (sampling or not), over kept contexts that go on, roll back (rejected
    drafts) and are rewritten after a table was freed: the one-call step's logits, in-kernel greedy picks and KV
    equal, bit for bit, the batch forward's over the same chunks and token-by-token decoding's."""
    from engine.scheduler import ScheduledChunk
    from engine.sequence import Sequence

    runner, blocks, exact = engine.runner, engine.blocks, mode == "execution"
    step = None

    def seq(rid, n, temperature=0.0):
        return Sequence(rid, _prompt(n, n), SamplingParams(max_tokens=64, temperature=temperature, seed=n), mode=mode)

    a, b, c, d = seq("a", 9), seq("b", 13, 0.8), seq("c", 6), seq("d", 10)
    for s in (a, b, c):  # prompts computed, one output token each
        blocks.grow(s.block_table, 48)
        runner.forward(runner.build_batch([ScheduledChunk(s, 0, len(s.prompt_token_ids), False, 0)], blocks, exact))
        s.output_token_ids = [7]
    blocks.grow(d.block_table, 48)

    def check(chunks):
        nonlocal step
        for ch in chunks:
            ch.seq.num_computed = ch.start
        step = runner._decode_step(chunks)
        assert isinstance(step, FusedDecodeStep)
        got, picks = step(chunks, blocks)
        got, kv = got.clone(), _kv(runner, blocks, chunks)
        races = picks if isinstance(picks, HeadPicks) else None  # b, a temperature row, raced in the lm_head's call
        picks = None if picks is None else (races.tokens if races is not None else picks).copy()
        draws = list(races.draws) if races is not None else []
        ref = runner.forward(runner.build_batch(chunks, blocks, exact))
        assert torch.equal(got, ref) and torch.equal(kv, _kv(runner, blocks, chunks))
        one = []  # token by token: each token a forward of its own, the chunk's logits rows kept
        for ch in chunks:
            for j in range(ch.num_tokens):
                row = runner.forward(runner.build_batch([ScheduledChunk(ch.seq, ch.start + j, 1, True, 1)], blocks,
                                                        exact))
                if j >= ch.num_tokens - ch.num_logits:
                    one.append(row)
        assert torch.equal(got, torch.cat(one)) and torch.equal(kv, _kv(runner, blocks, chunks))
        assert picks is not None  # a greedy row is in every step
        firsts = [i for i, s in enumerate(r for ch in chunks for r in [ch.seq] * ch.num_logits)
                  if s.params.plain_greedy]
        assert [int(picks[i]) for i in firsts] == got[firsts].numpy().argmax(-1).tolist()
        for i, draw in enumerate(draws):  # the races: the sampler's race over the same row and draw
            if draw is not None:
                assert int(picks[i]) == race_sample(got[i, :races.limit].numpy(), 0.8, *draw)[0]

    b.output_token_ids += [11, 12, 13]  # forced tokens: a chunk of 4, the last one samples
    c.draft_token_ids = [21, 22]  # a token and its drafts: 3 rows sample
    check([ScheduledChunk(a, 9, 1, True, 1), ScheduledChunk(b, 13, 4, True, 1), ScheduledChunk(c, 6, 3, True, 3),
           ScheduledChunk(d, 0, 4, False, 0)])
    a.output_token_ids.append(8)
    b.output_token_ids += [14, 15]
    c.output_token_ids, c.draft_token_ids = [7, 21, 23], [24]  # 22 rejected: c starts again at its position
    check([ScheduledChunk(a, 10, 1, True, 1), ScheduledChunk(b, 17, 2, True, 1), ScheduledChunk(c, 8, 2, True, 2),
           ScheduledChunk(d, 4, 6, True, 1)])
    assert step.contexts.kept  # the contexts went on from the first step
    a.output_token_ids += [9, 10]  # a's 11th token through a batch forward: past what the step's context holds
    runner.forward(runner.build_batch([ScheduledChunk(a, 11, 1, True, 1)], blocks, exact))
    b.output_token_ids += [16, 17]
    c.output_token_ids, c.draft_token_ids = [7, 21, 23, 24, 25, 26], []  # 24 accepted, 26 forced after 25
    d.output_token_ids = [30]
    check([ScheduledChunk(a, 12, 1, True, 1), ScheduledChunk(b, 19, 2, True, 1), ScheduledChunk(c, 10, 2, True, 1),
           ScheduledChunk(d, 10, 1, True, 1)])
    old = blocks.slots(d.block_table, 0, 11)
    blocks.free(d.block_table)  # d readmitted into other blocks (its table the same list, refilled) with a prefix
    for layer in runner.kv_caches:  # hit of 4 tokens: its chunk starts inside what the last step's d held; its
        for t in layer:  # old blocks hold another sequence's KV now
            t[old] = 0.0
    blocks.grow(c.block_table, 120)
    blocks.grow(d.block_table, 48)
    runner.forward(runner.build_batch([ScheduledChunk(d, 0, 4, False, 0)], blocks, exact))
    a.output_token_ids.append(11)
    b.output_token_ids.append(18)
    c.output_token_ids.append(27)
    check([ScheduledChunk(a, 13, 1, True, 1), ScheduledChunk(b, 21, 1, True, 1), ScheduledChunk(c, 12, 1, True, 1),
           ScheduledChunk(d, 4, 7, True, 1)])
    a.output_token_ids.append(12)
    c.output_token_ids.append(28)
    check([ScheduledChunk(c, 13, 1, True, 1), ScheduledChunk(a, 14, 1, True, 1)])  # other sequences at each index
    for s in (a, b, c, d):
        blocks.free(s.block_table)


def picks_per_run(monkeypatch, runner, seen) -> list:
    """`seen(runner.first_max)` after each of the runner's forwards, appended to the list returned."""
    run, out = runner.run, []

    def recorded(chunks, blocks):
        logits = run(chunks, blocks)
        out.append(seen(runner.first_max))
        return logits

    monkeypatch.setattr(runner, "run", recorded)
    return out


@pytest.mark.parametrize("mode", ["exploration", "execution"])
@pytest.mark.parametrize("limit", [None, 300])
def test_tokens_equal_with_the_in_kernel_pick_off(engine, mode, limit, monkeypatch):
    """The plain greedy rows' picks from the lm_head's call (`first_max`) give the tokens the sampler reads from
    the logits, batched with seeded rows, over the whole row and under a vocabulary limit (then a pick past the
    limit sends the row back to the logits)."""
    used = picks_per_run(monkeypatch, engine.runner, lambda first_max: first_max is not None)
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
    """A chunk that goes on from the last step's chunk at its index (the same sequence and table, starting at or before
    where that one ended: rejected drafts move the start back) writes only its new tokens' slots; a chunk whose
    sequence or table differs, that starts past the kept context, or any chunk after a table was freed (a freed table
    is refilled with other blocks), its whole context. Every token row then reads what `blocks.slots` reads."""
    from engine.kv_cache import BlockManager

    model = engine.runner.model
    step = FusedDecodeStep(model, model.fused_layers, model.fast_lm_head.packed, 1, engine.runner.layer_caches)
    blocks = BlockManager(64, 8)
    a, b = object(), object()  # two sequences: only their identity counts
    ta, tb = [], []
    blocks.grow(ta, 40)
    blocks.grow(tb, 40)

    def write(chunks):  # [(seq, table, start, end)] -> each token row's context as the stack reads it
        spans, ints, t = [], step._ints_np, 0
        for s, tab, start, end in chunks:
            for p in range(start, end):
                ints[1, t + p - start], ints[2, t + p - start] = p, tab[p // 8] * 8 + p % 8
            spans.append((s, tab, start, end, t))
            t += end - start
        longest = max(end for *_, end in chunks)
        if not step.contexts.fits(len(chunks), longest) or step._stack_call is None:
            step._grow(len(chunks), longest)
        step.contexts.write(spans, ints, t, blocks)
        return [step.contexts.slots_np[ints[3, i]:ints[3, i] + ints[4, i]].tolist() for i in range(t)]

    def want(chunks):
        return [blocks.slots(tab, 0, p + 1).tolist() for _, tab, start, end in chunks for p in range(start, end)]

    for chunks in ([(a, ta, 10, 11)], [(a, ta, 11, 12)], [(a, ta, 12, 13), (b, tb, 3, 4)],
                   [(a, ta, 13, 17), (b, tb, 4, 7)],  # a jump-forward chunk, a token and its drafts
                   [(a, ta, 17, 18), (b, tb, 5, 8)],  # b's last draft rejected: its chunk starts inside the last one
                   [(b, tb, 8, 9), (a, ta, 18, 19)], [(b, tb, 9, 10), (a, ta, 20, 21)]):  # a went on elsewhere
        assert write(chunks) == want(chunks)
    blocks.free(ta)  # `a` recomputed into other blocks: its table is the same list, refilled
    blocks.grow(tb, 302)
    blocks.grow(ta, 40)
    for chunks in ([(b, tb, 10, 11), (a, ta, 8, 16)], [(b, tb, 11, 12), (a, ta, 16, 17)], [(b, tb, 12, 13)],
                   [(b, tb, 300, 301)], [(b, tb, 301, 302)]):
        assert write(chunks) == want(chunks)


def test_jump_forward_steps_take_the_one_call_step():
    """JSON Schema output of the demo model with jump-forward, greedy and seeded together: the steps whose chunks carry
    forced tokens run the one-call step, with the logits bits of the batch forward over the same chunks."""
    from pathlib import Path

    from gateway.structured.build import build_constraint, json_schema_spec
    from gateway.structured.vocab import TokenizerInfo

    demo = Path(__file__).parents[2] / "engine" / "assets" / "demo-moe"
    engine = LLM(demo, progress=False, placement=PlacementConfig(fast_format="int4", exact_format="bf16"),
                 num_kv_blocks=128, jump_forward_tokens=32, prefix_cache=False).engine
    schema = {"type": "object", "properties": {"symbol": {"type": "string", "maxLength": 5},
                                               "side": {"enum": ["buy", "sell"]}, "quantity": {"type": "integer"}},
              "required": ["symbol", "side", "quantity"], "additionalProperties": False}
    tok = TokenizerInfo.from_file(demo / "tokenizer.json", sorted(engine.eos_token_ids))
    prompt = engine.tokenizer.encode("Buy 100 AAPL at market. Answer with the order:")
    runner, multi, compared = engine.runner, [], []
    decode_step = runner._decode_step

    def checked(chunks):
        step = decode_step(chunks)
        if step is None:
            return None

        def both(chunks, blocks):
            got, first_max = step(chunks, blocks)
            got = got.clone()
            ref = runner.forward(runner.build_batch(chunks, blocks, exact=True))
            compared.append(torch.equal(got, ref))
            multi.append(any(c.num_tokens > 1 for c in chunks))
            return got, first_max

        return both

    runner._decode_step = checked
    run_requests(engine, [(f"j{t}", prompt, SamplingParams(
        max_tokens=48, temperature=t, seed=3, logits_processors=[build_constraint(json_schema_spec(schema), tok,
                                                                                  max_tokens=48)]), "execution")
        for t in (0.0, 0.7)])
    assert engine.decoder.stats.forced_tokens > 0 and any(multi)
    assert compared and all(compared)


def _all_greedy(mode: str, tag: str) -> list:
    """Three greedy requests of different lengths (batches of 3, 2 and 1 greedy decodes)."""
    return [(f"{tag}-{i}", _prompt(6 + 5 * i, 20 + i), SamplingParams(max_tokens=5 + 3 * i, ignore_eos=True), mode)
            for i in range(3)]


@pytest.mark.parametrize("mode", ["exploration", "execution"])
@pytest.mark.parametrize("limit", [None, 300])
def test_one_call_step_equals_the_stack_and_lm_head_calls(engine, mode, limit, monkeypatch):
    """`moegate_decode_step` (`DecodeStepCall`: the stack, the lm_head and its picks or races in one call) writes the
    bits of the stack's call followed by the lm_head's (`DecodeStackCall`, then `LinearCall.picking` or `HeadRaceCall`)
    on the same inputs, its outputs poisoned first, at every step that takes it, batched and alone: greedy rows only,
    temperature rows only, both, and seeded rows with a top-k (no race, no pick), over the whole vocabulary and under
    a limit; a new slot outside the caches raises DecodeSlotsError from it, nothing written."""
    from kernels.bindings import DecodeSlotsError, DecodeStepCall

    runner, compared = engine.runner, []
    one_call, one_race = DecodeStepCall.__call__, DecodeStepCall.racing
    monkeypatch.setattr(engine, "vocab_limit", limit)
    monkeypatch.setattr(runner, "vocab_limit", limit)

    def state(step, t, n):  # what the calls write: the hidden rows, KV, routing counts, normed rows, logits, picks
        race = step._race_call
        return [step._x.clone(), *(b.clone() for kv in runner.layer_caches for b in kv),
                *(f.packed.counts.clone() for f in step.stack.layers), step._normed[:t].clone(), step._logits[:n].clone(),
                step._first_max[:n].clone(), torch.from_numpy(race.picks[:n].copy()),
                torch.from_numpy(race.best[:n].copy())]

    def compare(call, t, n, kind, two_calls, the_call):
        step = next(s for s in runner._decode_steps.values() if s._step_call is call)
        before = state(step, t, n)
        two_calls(step)
        want = state(step, t, n)
        inputs = [step._x, *(b for kv in runner.layer_caches for b in kv), *(f.packed.counts for f in step.stack.layers)]
        for buf, saved in zip(inputs, before, strict=False):  # the inputs as they were before the two calls
            buf.copy_(saved)
        for out in (step._normed, step._logits):  # what the one call must write itself
            out.fill_(float("nan"))
        step._first_max.fill_(-1)
        step._race_call.picks.fill(-1)
        step._race_call.best.fill(np.nan)
        the_call()
        got = state(step, t, n)
        # the picks it writes: first_max (greedy), the race's picks and best (race), none
        skip = {"greedy": (-2, -1), "race": (-3,), "none": (-3, -2, -1)}[kind[0]]
        keep = [i for i in range(len(got)) if i - len(got) not in skip]
        compared.append((t, kind[1], all(torch.equal(got[i], want[i]) for i in keep)))

    def both(call, t, n, pick):
        def two(step):
            call.stack(t)
            call.head.picking(n) if pick else call.head(n)

        compare(call, t, n, ("greedy" if pick else "none", "greedy" if pick else "none"), two,
                lambda: one_call(call, t, n, pick))

    def racing(call, t, n, lim):
        temps = call.race.temps[:n]
        kind = "race" if (temps > 0).all() else "mixed"

        def two(step):
            call.stack(t)
            call.race(n, lim)

        compare(call, t, n, ("race", kind), two, lambda: one_race(call, t, n, lim))

    monkeypatch.setattr(DecodeStepCall, "__call__", both)
    monkeypatch.setattr(DecodeStepCall, "racing", racing)
    run_requests(engine, _requests(mode, f"one-{mode}-{limit}"))  # greedy and temperature rows, then one alone
    run_requests(engine, _all_greedy(mode, f"one-greedy-{mode}-{limit}"))
    run_requests(engine, _requests(mode, f"one-topk-{mode}-{limit}", top_k=50))
    seen = {(t, kind) for t, kind, _ in compared}
    assert {(4, "mixed"), (3, "mixed"), (1, "race"), (3, "greedy"), (1, "greedy"), (1, "none")} <= seen, seen
    assert all(ok for *_, ok in compared)
    monkeypatch.undo()
    step = runner._decode_steps[mode == "execution"]
    before = [t.clone() for kv in runner.layer_caches for t in kv]
    slot = int(step._ints[2, 0])
    step._ints[2, 0] = step._step_call.stack.slots_per_cache  # the first row's new slot past every cache
    try:
        for call in (lambda: step._step_call(1, 1, True), lambda: step._step_call.racing(1, 1, 100)):
            with pytest.raises(DecodeSlotsError, match="bad block table"):
                call()
    finally:
        step._ints[2, 0] = slot
    assert all(torch.equal(t, b) for t, b in zip((t for kv in runner.layer_caches for t in kv), before, strict=True))


def test_racing_rows_take_the_one_call(engine, monkeypatch):
    """A step of decodes with a plain temperature row runs the stack, the lm_head and its races in one call
    (`DecodeStepCall.racing`), never the stack's call then the racing lm_head's (`_racing`); its tokens are those of
    the sampler's own race over the logits (the in-kernel picks off)."""
    from kernels.bindings import DecodeStepCall

    calls: list[str] = []
    one_race, racing, step_call = DecodeStepCall.racing, FusedDecodeStep._racing, FusedDecodeStep.__call__

    def counted_one_race(call, *args):
        calls.append("one")
        return one_race(call, *args)

    def counted_racing(step, *args):
        calls.append("two")
        return racing(step, *args)

    def stepped(step, chunks, blocks):
        calls.append("decodes" if all(c.num_tokens == 1 for c in chunks) else "other")
        return step_call(step, chunks, blocks)

    monkeypatch.setattr(DecodeStepCall, "racing", counted_one_race)
    monkeypatch.setattr(FusedDecodeStep, "_racing", counted_racing)
    monkeypatch.setattr(FusedDecodeStep, "__call__", stepped)
    on = run_requests(engine, _requests("exploration", "race-one"))  # a seeded row in every decode step
    decodes = [calls[i + 1] for i, c in enumerate(calls) if c == "decodes"]
    assert decodes and set(decodes) == {"one"}
    with monkeypatch.context() as m:
        m.setattr(FusedDecodeStep, "pick_in_kernel", False)
        off = run_requests(engine, _requests("exploration", "race-off"))
    assert [on[f"race-one-{i}"] for i in range(4)] == [off[f"race-off-{i}"] for i in range(4)]
