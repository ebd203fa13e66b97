"""The fused decode step: a step of up to SMALL_BATCH_TOKENS tokens (decodes, jump-forward chunks, a token and its
drafts, short prefill chunks) on a fused stack (engine/models/fused_decode.py), token ids to logits (and the lm_head's
greedy picks or temperature races) in one kernel call, or two where a row does not sample or has logits processors,
over buffers kept between steps, which `ModelRunner.run` takes instead of the batch forward (the same bits)."""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.sampler import HeadPicks, coming_draw
from kernels.bindings import DecodeStackCall, DecodeStepCall, HeadRaceCall, LinearCall, cache_slots

if TYPE_CHECKING:
    from engine.models.fused_decode import FusedStack

_M64 = (1 << 64) - 1  # the race's key and counter are taken mod 2^64 (kernels/race_noise.py)
SMALL_BATCH_TOKENS = 16  # the one-call step's rows (its kept buffers); a step of more tokens takes the batch forward


class FusedDecodeStep:
    """A step of up to SMALL_BATCH_TOKENS tokens on a fused stack, token ids to logits: decodes (one token, one
    logits row), jump-forward chunks (several tokens, the last samples), a token and its drafts (every row samples)
    and short prefill chunks, each token a row of the stack's call. The embedding rows, RoPE rows, KV slots and
    contexts are written through numpy into buffers kept between steps (a step of decodes that go on from the last
    step's rows: item by item through flat memoryviews of them, `_decodes`), then one `moegate_decode_stack` call
    (every layer and the final norm) and one lm_head call (`moegate_linear`) over the rows that sample: where every
    row samples and none has logits processors, both in one call (`moegate_decode_step`, with the greedy picks or the
    plain temperature rows' races: `_races`). The same kernels on the same inputs as `MoeForCausalLM.forward` and
    `compute_logits` over a ForwardBatch (the embedding and RoPE rows are copies of the same rows), so the same bits,
    without the batch's tensors and the ~20 torch ops and module calls around the kernel calls."""

    pick_in_kernel = True  # the lm_head's call finds the plain greedy rows' picks and runs the plain temperature rows'
    # races (off: the sampler reads the logits)
    vocab_limit: int | None = None  # the sampler's (the runner sets it): the races run over the first vocab_limit logits
    keep_hidden = False  # MTP drafts: a copy of every row's final hidden state in `hidden` [T, H]

    def __init__(self, model, stack: FusedStack, head, head_threads: int, kv_caches: list) -> None:
        cfg, rows = model.config, SMALL_BATCH_TOKENS
        self.stack, self.head = stack, head  # what the step was built for: the runner checks them each step
        self.embed = model.model.embed_tokens.weight.detach().numpy()  # [V, H] fp32, the same memory
        self.rotary = model.model.layers[0].self_attn.rotary  # its position table: `_rope`'s rows
        self._table: torch.Tensor | None = None
        self._table_len, self._head_dim, self._hidden = 0, cfg.head_dim, cfg.hidden_size
        self._tables: tuple | None = None
        self._f32 = torch.float32  # the rotary's key of its fp32 table
        self._x = torch.empty(rows, cfg.hidden_size)  # [R, H] the embedding rows, then the stack's hidden
        self._normed = torch.empty(rows, cfg.hidden_size)  # [R, H] after the final norm: the lm_head's input
        self._rope = torch.empty(2, rows, cfg.head_dim)  # cos, sin rows [R, D]
        self._ints = torch.empty(5, rows, dtype=torch.int64)  # ids, positions, new slots, context start, length
        self._ids = torch.empty(rows, stack.layers[0].top_k, dtype=torch.int64)  # [R, K] scratch
        self.contexts = StepContexts()  # the chunks' context slots, kept between steps
        self._x_np, self._rope_np, self._ints_np = self._x.numpy(), self._rope.numpy(), self._ints.numpy()
        self._normed_np = self._normed.numpy()
        # flat memoryviews of the same memory: a decode row's writes (`_decodes`) as item and slice assignments, a
        # fraction of numpy's indexing machinery, whose code and data are cold right after the kernels
        self._x_mv, self._rope_mv, self._ints_mv = _flat(self._x_np), _flat(self._rope_np), _flat(self._ints_np)
        self._embed_mv = _flat(self.embed)
        self._table_mv: tuple[memoryview, memoryview] | None = None
        n = len(stack)
        self._kv = ((ctypes.c_void_p * n)(*(c[0].data_ptr() for c in kv_caches)),
                    (ctypes.c_void_p * n)(*(c[1].data_ptr() for c in kv_caches)))
        self._cache_slots = cache_slots(stack.params, kv_caches)
        self._norm = (model.model.norm.weight.detach(), model.model.norm.eps)
        self._stack_call: DecodeStackCall | None = None
        self._step_call: DecodeStepCall | None = None  # the stack and the lm_head (its picks or races) in one call
        # [R, V rounded up to 8]: the logits, kept (valid until the next step, as the runner's token buffer): a fresh
        # 0.6 MB tensor per step cost ~20 us of page faults here. Not where a row has logits processors: they are
        # handed rows and may keep them, so those steps' logits are fresh
        self._logits = torch.empty(rows, head.padded_out)
        self._kept_views: dict[int, tuple] = {}  # its first rows [T, V] and first_max's [T] by T (`_views`)
        # [R]: each row's first largest logit, found in the lm_head's call by the threads that wrote the columns (the
        # stepping thread would read the row back from the other core's cache: ~240 us for 152k logits at 1 row)
        self._first_max = torch.empty(rows, dtype=torch.int64)
        self._first_max_np = self._first_max.numpy()
        self._head_call = LinearCall(stack.lib, head, self._normed, self._logits, head_threads, self._first_max)
        # the same call with each plain temperature row's race scored while its columns are hot (the sampler's
        # `moegate_race_sample` read the row back from the other core's cache) and the other rows' first largest
        self._race_call = HeadRaceCall(self._head_call)
        self._race_views: dict[int, tuple] = {}  # (logits [n, V], picks, best [n]) by n (`_race_picks`)
        # flat memoryviews of the races' inputs: temps 'f', keys and counters 'Q' (`_decodes` writes them item by item)
        self._race_mv = tuple(_flat(a) for a in (self._race_call.temps, self._race_call.keys, self._race_call.counters))
        # the lm_head is the step's last kernel call: the pool's helpers sleep now instead of spinning ~200 us for a job
        # that comes only with the next step, on a core the stepping thread (and anything else) could use
        self._rest = getattr(stack.lib, "moegate_pool_rest", lambda: None)

    @staticmethod
    def takes(model) -> bool:
        """Whether the model's embedding and final norm are what the step reads directly (fp32 on the CPU)."""
        e, n = model.model.embed_tokens.weight, model.model.norm
        return (e.dtype == n.weight.dtype == torch.float32 and e.device.type == n.weight.device.type == "cpu"
                and e.is_contiguous() and not n.zero_centred)

    def __call__(self, chunks: list, blocks) -> tuple[torch.Tensor, np.ndarray | HeadPicks | None]:
        """chunks: ScheduledChunks of at most SMALL_BATCH_TOKENS tokens in all -> fp32 logits [S, V]: the `num_logits`
        last rows of each chunk, in chunk order (as `ModelRunner.run`), a view of a buffer the next call overwrites
        unless a row has logits processors (then a tensor of their own); and where a row is plain greedy
        (`pick_in_kernel`), each logits row's first largest logit [S] int64 found by the lm_head's call (a view of a
        buffer the next call overwrites), else None; where a row is a plain temperature row, a HeadPicks: those picks and
        the races run in the same call (`_races`). Every token is a row of the stack's call over its own context:
        its sequence's positions 0..its own, the chunk's earlier tokens included (the kernel writes all rows' K/V
        before any row attends), as the batch forward's fused layers compute a chunk."""
        if (rows := self._decodes(chunks, blocks)) is not None:
            t, (greedy, processors, draws), every = len(chunks), rows, True
        else:
            t, greedy, processors, every = self._inputs(chunks, blocks)
            draws = self._races(chunks) if self.pick_in_kernel else None
        pick = self.pick_in_kernel and greedy
        if every and not processors:  # the stack, the lm_head (its picks or races), the pool's rest: one call
            if draws is None:
                self._step_call(t, t, pick)
                self.hidden = self._normed[:t].clone() if self.keep_hidden else None
                return self._views(t, pick)
            limit = self._limit()
            self._step_call.racing(t, t, limit)
            self.hidden = self._normed[:t].clone() if self.keep_hidden else None
            logits, picks, best = self._race_picks(t)
            return logits, HeadPicks(picks, best, draws, limit)
        self._stack_call(t)
        self.hidden = self._normed[:t].clone() if self.keep_hidden else None
        n = t if every else self._compact(chunks)
        if n == 0:
            return torch.empty(0, self.head.out_features), None
        if draws is not None:
            return self._racing(n, draws, processors)
        if processors:
            picks = self._views(n, pick)[1]
            logits = torch.empty(n, self.head.padded_out)
            self._head_call(n, logits, self._first_max if pick else None)
            self._rest()
            return logits[:, :self.head.out_features], picks
        if pick:
            self._head_call.picking(n)
        else:
            self._head_call(n)
        self._rest()
        return self._views(n, pick)

    def _views(self, n: int, pick: bool) -> tuple[torch.Tensor, np.ndarray | None]:
        """The kept logits' first n rows [n, V] and, where `pick`, the kept picks' [n] (views kept by n)."""
        if (views := self._kept_views.get(n)) is None:
            views = self._kept_views[n] = (self._logits[:n, :self.head.out_features], self._first_max_np[:n])
        return views if pick else (views[0], None)

    def _races(self, chunks: list) -> list | None:
        """The race inputs of the rows that sample, in order (HeadRaceCall's temps, keys, counters): a plain
        temperature row (`SamplingParams.plain_race`) of a chunk that samples one row races its sequence's next draw,
        any other takes its first largest logit -> each row's (key, counter), None where it does not race; None where
        no row races."""
        if not any(c.num_logits == 1 and c.seq.params.plain_race for c in chunks):
            return None  # no row races: nothing written
        race = self._race_call
        draws: list = []
        for c in chunks:
            if c.num_logits == 1 and c.seq.params.plain_race:
                key, counter = coming_draw(c.seq)
                i = len(draws)
                race.temps[i], race.keys[i], race.counters[i] = c.seq.params.temperature, key & _M64, counter & _M64
                draws.append((key, counter))
            elif c.num_logits:
                race.temps[len(draws):len(draws) + c.num_logits] = 0.0
                draws += [None] * c.num_logits
        return draws

    def _racing(self, n: int, draws: list, processors: bool) -> tuple[torch.Tensor, HeadPicks]:
        """The lm_head's call over the n rows that sample with the races `_races` set up -> (logits, their picks)."""
        limit, (kept, picks, best) = self._limit(), self._race_picks(n)
        if processors:
            logits = torch.empty(n, self.head.padded_out)
            self._race_call(n, limit, logits)
            self._rest()
            return logits[:, :self.head.out_features], HeadPicks(picks, best, draws, limit)
        self._race_call(n, limit)
        self._rest()
        return kept, HeadPicks(picks, best, draws, limit)

    def _limit(self) -> int:
        """The logits the races run over: the sampler's vocabulary limit, at most the lm_head's outputs."""
        return self.head.out_features if self.vocab_limit is None else min(self.vocab_limit, self.head.out_features)

    def _race_picks(self, n: int) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        """The kept logits' first n rows [n, V] and the race call's kept picks' and best's [n] (views kept by n)."""
        if (views := self._race_views.get(n)) is None:
            race = self._race_call
            views = self._race_views[n] = (self._views(n, False)[0], race.picks[:n], race.best[:n])
        return views

    def _decodes(self, chunks: list, blocks) -> tuple[bool, bool, list | None] | None:
        """A step of decodes whose contexts the last step wrote (each chunk one token that samples, its sequence and
        table in the same region as then, no table freed since, within the region and the RoPE table): each row's
        inputs written item by item through the flat views, its context's one new slot included, and where the
        lm_head picks (`pick_in_kernel`) its race's inputs as `_races` writes them -> (a row is plain greedy, a row
        has logits processors, `_races`' draws); else None, nothing written (`_inputs` then writes every row)."""
        ctx, bs = self.contexts, blocks.block_size
        kept, region, slots = ctx.kept, ctx.region, ctx.slots_mv
        if (len(chunks) > len(kept) or blocks.frees != ctx.frees or blocks is not ctx.blocks
                or self.rotary._tables.get(self._f32) is not self._tables):
            return None
        for c, k in zip(chunks, kept, strict=False):
            seq = c.seq
            if (c.num_tokens != 1 or c.num_logits != 1 or k[0] is not seq or k[1] is not seq.block_table
                    or c.start > k[2] or c.start >= region or c.start >= self._table_len):
                return None
        iv, R, D, H = self._ints_mv, SMALL_BATCH_TOKENS, self._head_dim, self._hidden
        rope, (cos, sin), x, embed = self._rope_mv, self._table_mv, self._x_mv, self._embed_mv
        greedy = processors = False
        race, draws = self.pick_in_kernel, None
        for i, c in enumerate(chunks):
            seq, pos = c.seq, c.start
            table, params = seq.block_table, seq.params
            greedy = greedy or params.plain_greedy
            processors = processors or bool(params.logits_processors)
            if race and params.plain_race:
                temps, keys, counters = self._race_mv
                if draws is None:
                    draws = [None] * len(chunks)
                    for j in range(i):
                        temps[j] = 0.0
                draws[i] = key, counter = coming_draw(seq)
                temps[i], keys[i], counters[i] = params.temperature, key & _M64, counter & _M64
            elif draws is not None:
                self._race_mv[0][i] = 0.0
            token, slot, at = seq.tokens(pos, pos + 1)[0], table[pos // bs] * bs + pos % bs, i * region
            iv[i], iv[R + i], iv[2 * R + i], iv[3 * R + i], iv[4 * R + i] = token, pos, slot, at, pos + 1
            slots[at + pos] = slot  # the context's new slot, as `StepContexts.write`
            rope[i * D:(i + 1) * D] = cos[pos * D:(pos + 1) * D]  # `_rope`'s rows: cos [R, D], then sin [R, D]
            rope[(R + i) * D:(R + i + 1) * D] = sin[pos * D:(pos + 1) * D]
            x[i * H:(i + 1) * H] = embed[token * H:(token + 1) * H]  # the embedding row
            kept[i] = (seq, table, pos + 1)
        del kept[len(chunks):]
        return greedy, processors, draws

    def _inputs(self, chunks: list, blocks) -> tuple[int, bool, bool, bool]:
        """Every row's inputs (ids, positions, new slots, contexts, RoPE and embedding rows) for any step the fused
        call takes -> (rows, a row is plain greedy, a row has logits processors, every row samples)."""
        bs, ints = blocks.block_size, self._ints_np
        spans, longest, t, greedy, processors, every = [], 0, 0, False, False, True
        for c in chunks:
            seq, pos, k = c.seq, c.start, c.num_tokens
            table, params = seq.block_table, seq.params
            greedy = greedy or params.plain_greedy
            processors = processors or bool(params.logits_processors)
            every = every and c.num_logits == k
            if k == 1:  # a decode row
                ints[0, t] = seq.tokens(pos, pos + 1)[0]
                ints[1, t] = pos
                ints[2, t] = table[pos // bs] * bs + pos % bs  # `blocks.slots`' rule, as build_batch
            else:  # several tokens: jump-forward's forced ones, a token and its drafts, a short prefill chunk
                ints[0, t:t + k] = seq.tokens(pos, pos + k)
                ints[1, t:t + k] = range(pos, pos + k)
                ints[2, t:t + k] = [table[p // bs] * bs + p % bs for p in range(pos, pos + k)]
            spans.append((seq, table, pos, pos + k, t))
            longest = max(longest, pos + k)
            t += k
        if not self.contexts.fits(len(chunks), longest) or self._stack_call is None:
            self._grow(len(chunks), longest)
        self.contexts.write(spans, ints, t, blocks)
        table = self.rotary._table(longest, torch.float32)  # cos, sin [P, D]
        if table[0] is not self._table:
            self._table, self._table_np = table[0], (table[0].numpy(), table[1].numpy())
            self._table_mv, self._table_len = tuple(_flat(np.ascontiguousarray(a)) for a in self._table_np), len(table[0])
        self._tables = table  # what `_table` returned: `_decodes` reads rows of it while the rotary keeps it
        positions, cos, sin = ints[1, :t], *self._rope_np[:, :t]
        self._table_np[0].take(positions, axis=0, out=cos)
        self._table_np[1].take(positions, axis=0, out=sin)
        self.embed.take(ints[0, :t], axis=0, out=self._x_np[:t])
        return t, greedy, processors, every

    def _compact(self, chunks: list) -> int:
        """The rows that sample (each chunk's `num_logits` last), moved in order to the top of the lm_head's input
        -> their number. The batch forward's lm_head gets the same rows (`hidden[logits_rows]`)."""
        rows, t = [], 0
        for c in chunks:
            t += c.num_tokens
            rows.extend(range(t - c.num_logits, t))
        if rows:
            self._normed_np[:len(rows)] = self._normed_np[rows]  # a gather: the source is read before it is written
        return len(rows)

    def _grow(self, n: int, longest: int) -> None:
        """The contexts hold `n` chunks' regions of at least `longest` slots, and the kernel calls point at them."""
        self.contexts.grow(n, longest)
        i = self._ints
        self._stack_call = DecodeStackCall(
            self.stack.lib, self.stack.params, self._x, self._rope[0], self._rope[1], *self._kv, i[2], self.contexts.slots,
            i[3], i[4], self._ids, self.stack.counts, self.stack.num_threads, (*self._norm, self._normed),
            self._cache_slots)
        self._step_call = DecodeStepCall(self._stack_call, self._head_call, self._race_call)


class StepContexts:
    """The chunks' context slots of a fused step, kept between steps: chunk i's (its sequence's positions 0..end-1) at
    [i * region, i * region + end) of one int64 buffer, grown on demand (doubling), and what each chunk held at the
    last step (sequence, table, end): a chunk that goes on writes its new slots only."""

    def __init__(self) -> None:
        self.slots, self.region = torch.empty(0, dtype=torch.int64), 0
        self.slots_np, self.slots_mv = self.slots.numpy(), None
        self.kept: list[tuple] = []
        self.frees, self.blocks = -1, None

    def fits(self, n: int, longest: int) -> bool:
        return longest <= self.region and n * self.region <= self.slots.shape[0]

    def grow(self, n: int, longest: int) -> None:
        """Room for `n` chunks' regions of at least `longest` slots; every chunk's context is written again."""
        if longest > self.region:
            self.region = max(longest, 2 * self.region, 256)
        if self.slots.shape[0] < n * self.region:
            self.slots = torch.empty(max(n, 4) * self.region, dtype=torch.int64)
            self.slots_np = self.slots.numpy()
            self.slots_mv = _flat(self.slots_np)
        self.kept.clear()

    def write(self, spans: list, ints: np.ndarray, t: int, blocks) -> None:
        """spans [(sequence, table, start, end, first token row)] per chunk: chunk i's context slots (its sequence's
        positions 0..end-1) at the start of region i of the contexts' buffer, and each of the t token rows' context
        (that region, its position + 1 slots). A chunk that holds the same sequence and table as the last step's chunk
        i, starting at or before where that one ended, with no table freed since (a running sequence's table only
        grows; rejected drafts move the start back), gets its new tokens' slots only; any other its whole context.
        ints: the step's [5, R] int64 rows (new slots in row 2; context starts and lengths written to rows 3, 4)."""
        slots, kept, region = self.slots_np, self.kept, self.region
        if blocks.frees != self.frees or blocks is not self.blocks:
            kept.clear()
            self.frees, self.blocks = blocks.frees, blocks
        for i, (seq, table, start, end, row) in enumerate(spans):
            at = i * region
            if i < len(kept) and (k := kept[i])[0] is seq and k[1] is table and start <= k[2]:
                slots[at + start:at + end] = ints[2, row:row + end - start]  # the new tokens' slots
            else:
                slots[at:at + end] = blocks.slots(table, 0, end).numpy()
            ints[3, row:row + end - start] = at
        np.add(ints[1, :t], 1, out=ints[4, :t])
        kept[:] = [(seq, table, end) for seq, table, _, end, _ in spans]


def _flat(a: np.ndarray) -> memoryview:
    """A C-contiguous array's memory as a flat memoryview of its items (float32 'f', int64 'q', uint64 'Q')."""
    return memoryview(a).cast("B").cast({np.float32: "f", np.int64: "q", np.uint64: "Q"}[a.dtype.type])
