"""ModelRunner: owns the model and its KV pools on the device; turns scheduled chunks into logits.

Exploration chunks share one batched forward (with expert deferral when configured). Execution chunks
(decodes and prefill chunks alike) share another, with the exact profile and no deferral, on the fused
execution path (engine/models/fused_decode.py): each row's arithmetic there is fixed by the row alone,
so its bytes never depend on what else is in flight or on how its prompt was chunked. Where that path
is not built (architectures it does not cover, CUDA, non-fp32 dtypes) each execution chunk runs in a
forward of its own on torch, batch invariant by serialising. A step of decodes only on the fused path runs
without a ForwardBatch (`FusedDecodeStep`: token ids to logits in two kernel calls, the same bits), a step of
small chunks too (jump-forward's forced tokens, drafts).
"""

from __future__ import annotations

import numpy as np
import torch

from engine.expert_pipeline import ExpertPipeline
from engine.forward_batch import ForwardBatch
from engine.kv_cache import BlockManager, KVCacheSpec, allocate_kv_cache
from engine.models.causal_lm import MoeForCausalLM
from engine.models.fused_step import SMALL_BATCH_TOKENS, FusedDecodeStep
from engine.recurrent_state import RecurrentStates, layer_caches
from engine.sampler import HeadPicks
from engine.scheduler import ScheduledChunk

# Forwards of at most this many tokens run the dense path on one torch thread: their matmuls are
# small and memory-bound, and torch's OpenMP pool costs more than it gains there (17x slower decode
# measured on a 2-core machine under load; the expert kernel has its own work-claiming pool).
SMALL_FORWARD_TOKENS = 16


class ModelRunner:
    def __init__(
        self, model: MoeForCausalLM, spec: KVCacheSpec, device: torch.device, kv_dtype: torch.dtype,
        defer: int = 0, states: RecurrentStates | None = None,
    ):
        self.model = model
        self.device, self._on_cpu = device, device.type == "cpu"  # (the latter read at every step: `_decode_step`)
        self.spec = spec
        self.defer = defer
        self.kv_caches = allocate_kv_cache(model.config, spec, kv_dtype, device)  # KV layers only
        self.states = states
        self.layer_caches = layer_caches(model.config, self.kv_caches, states)  # per layer: KV or recurrent state
        self.experts = ExpertPipeline(device, worker=defer > 0)  # deferral needs the expert thread
        self.strict_experts = ExpertPipeline(device)  # execution: everything now, on this thread
        self.expert_worker = self.experts.executor
        self.max_threads = torch.get_num_threads()
        self._one_thread = False  # a fused step set torch's pool to 1 and no forward ran since: `run` skips the check
        self._all_rows = torch.arange(64)  # `_rows`: read-only, sliced
        self._row_views: dict[int, torch.Tensor] = {}  # its slices by length
        # `_token_tensors`: the latest batch's ids, positions and KV slots [3, capacity] int64, written through
        # numpy; the batch's tensors are kept views of it, so a decode step makes no tensor for them
        self._token_buffer = torch.empty(3, 0, dtype=torch.long)
        self._token_views: dict[int, tuple[torch.Tensor, ...]] = {}
        self._decode_steps: dict[bool, FusedDecodeStep] = {}  # per profile (exact): `_decode_step`
        self.first_max: np.ndarray | HeadPicks | None = None  # the last `run`'s in-kernel picks, one per row (or None)
        self.vocab_limit: int | None = None  # the sampler's (the engine sets it): the in-kernel races run over it
        self.keep_hidden = False  # MTP drafts: `run` keeps each chunk's final hidden states in `hidden`
        self.hidden: list[torch.Tensor] | None = None  # [num_tokens, H] per chunk of the last `run`, in chunk order
        self._hidden: torch.Tensor | None = None

    def set_defer(self, defer: int) -> None:
        """Exploration's deferral for the batches built from now on (between steps)."""
        self.defer = defer
        if defer:
            self.expert_worker = self.experts.start_worker()

    def build_batch(self, chunks: list[ScheduledChunk], blocks: BlockManager, exact: bool = False) -> ForwardBatch:
        bs = blocks.block_size
        ids, positions, slot_mapping, ctx_slots, rows = [], [], [], [], []
        row = 0
        for c in chunks:
            end, table = c.start + c.num_tokens, c.seq.block_table
            ids.extend(c.seq.tokens(c.start, end))
            positions.extend(range(c.start, end))
            # the new tokens' slots (the context's last ones, `blocks.slots`' rule) in Python: slicing the context
            # tensor and `tolist` cost ~10 us per decode row, this ~1 us
            slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(c.start, end))
            ctx_slots.append(blocks.slots(table, 0, end))  # [end], kept between steps
            row += c.num_tokens
            rows.extend(range(row - c.num_logits, row))
        input_ids, positions, slot_mapping = self._token_tensors(ids, positions, slot_mapping)
        batch = ForwardBatch(
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slot_mapping,
            query_lens=[c.num_tokens for c in chunks],
            context_lens=[c.start + c.num_tokens for c in chunks],
            context_slots=ctx_slots,
            logits_rows=self._rows(rows, row),
            exact=exact,
            defer=0 if exact else self.defer,
            expert_pipeline=self.strict_experts if exact else self.experts,
            state_slots=[c.seq.state_slot for c in chunks] if self.states is not None else [],
        )
        return batch.to(self.device) if self.device.type != "cpu" else batch

    def _token_tensors(self, *columns: list[int]) -> tuple[torch.Tensor, ...]:
        """ids, positions, slots (each [T] int64) as views of the runner's token buffer: valid until the next
        `build_batch`, which `run` calls only after the previous batch's forward returned."""
        n = len(columns[0])
        if self._token_buffer.shape[1] < n:
            self._token_buffer = torch.empty(3, max(n, 2 * self._token_buffer.shape[1], 64), dtype=torch.long)
            self._token_views.clear()
        values = self._token_buffer.numpy()  # the same memory
        for i, column in enumerate(columns):
            values[i, :n] = column
        if (views := self._token_views.get(n)) is None:
            views = self._token_views[n] = tuple(self._token_buffer[:, :n])  # each row contiguous
        return views

    def _rows(self, rows: list[int], num_tokens: int) -> torch.Tensor:
        """The logits rows [S] as a tensor; every row in order (decode steps) is a slice of one kept arange."""
        if len(rows) != num_tokens:
            return torch.tensor(rows, dtype=torch.long)
        if self._all_rows.numel() < num_tokens:
            self._all_rows = torch.arange(max(num_tokens, 2 * self._all_rows.numel()))
            self._row_views.clear()
        if (view := self._row_views.get(num_tokens)) is None:
            view = self._row_views[num_tokens] = self._all_rows[:num_tokens]
        return view

    def run(self, chunks: list[ScheduledChunk], blocks: BlockManager) -> torch.Tensor:
        """All scheduled chunks -> fp32 logits [S, V]: `num_logits` rows per chunk that samples, in chunk order. A
        fused decode step's (`_decode_step`) are a view of that step's kept buffer: valid until the next `run`."""
        self.first_max = self.hidden = None
        if (step := self._decode_step(chunks)) is not None:
            if (not self._one_thread or self.keep_hidden) and torch.get_num_threads() != 1:  # (MTP's layer sets them)
                torch.set_num_threads(1)  # a small forward's rule (`forward`): nothing here runs on torch's
            self._one_thread = True
            step.keep_hidden = self.keep_hidden
            logits, self.first_max = step(chunks, blocks)  # and the greedy picks from the lm_head's own call
            if self.keep_hidden:
                self.hidden = list(step.hidden.split([c.num_tokens for c in chunks]))
            return logits
        hidden: dict[int, torch.Tensor] = {}
        explore = [c for c in chunks if c.seq.mode != "execution"]
        execute = [c for c in chunks if c.seq.mode == "execution"]
        groups = [(explore, False)] if explore else []
        if self.model.batch_invariant(True):
            groups += [(execute, True)] if execute else []
        else:
            groups += [([c], True) for c in execute]
        logits: dict[int, torch.Tensor] = {}
        for group, exact in groups:
            out = self.forward(self.build_batch(group, blocks, exact))
            if self.keep_hidden:
                hidden.update(zip(map(id, group), self._hidden.split([c.num_tokens for c in group]), strict=True))
                self.hidden = [hidden.get(id(c)) for c in chunks]
            if len(groups) == 1 and all(c.samples for c in chunks):
                return out  # its rows are already in chunk order: no copy of [S, V]
            sampling = [c for c in group if c.samples]
            for c, rows in zip(sampling, out.split([c.num_logits for c in sampling]), strict=True):
                logits[id(c)] = rows
        sampled = [logits[id(c)] for c in chunks if c.samples]
        return torch.cat(sampled) if sampled else torch.empty(0, self.model.config.vocab_size)

    def _decode_step(self, chunks: list[ScheduledChunk]) -> FusedDecodeStep | None:
        """The fused one-call step for these chunks (engine/models/fused_step.py), or None: a step of at most
        SMALL_BATCH_TOKENS tokens in all (decodes, jump-forward chunks, drafts, short prefill chunks) of one mode,
        where that mode's forward would run the fused stack and a compiled lm_head anyway (exploration: no
        deferral)."""
        if not self._on_cpu or not 0 < len(chunks) <= SMALL_BATCH_TOKENS:
            return None
        exact, tokens = chunks[0].seq.mode == "execution", 0
        for c in chunks:
            tokens += c.num_tokens
            if (c.seq.mode == "execution") != exact:
                return None
        if tokens > SMALL_BATCH_TOKENS:
            return None
        model = self.model
        if exact:
            stack, head = model.exact_layers, model.exact_head
            threads = stack.num_threads if stack is not None else 0
        else:
            lm = model.fast_lm_head
            stack, head = model.fused_layers, lm.packed if lm is not None and not self.defer else None
            threads = lm.num_threads if head is not None else 0
        if stack is None or head is None:
            return None
        step = self._decode_steps.get(exact)
        if step is None or step.stack is not stack or step.head is not head:
            if not FusedDecodeStep.takes(model):
                return None
            step = self._decode_steps[exact] = FusedDecodeStep(model, stack, head, threads, self.layer_caches)
        step.vocab_limit = self.vocab_limit
        return step

    @torch.inference_mode()
    def read_block(self, block: int) -> torch.Tensor:
        """A CPU copy of one KV block: [L, tensors, block_size, heads, width] (`ModelConfig.kv_cache_layout`)."""
        rows = slice(block * self.spec.block_size, (block + 1) * self.spec.block_size)
        return torch.stack([torch.stack([t[rows] for t in layer]) for layer in self.kv_caches]).cpu()

    @torch.inference_mode()
    def write_block(self, block: int, kv: torch.Tensor) -> None:
        """Copies kv [L, tensors, block_size, heads, width] into one KV block."""
        rows = slice(block * self.spec.block_size, (block + 1) * self.spec.block_size)
        kv = kv.to(self.device, non_blocking=True)
        for layer, tensors in enumerate(self.kv_caches):
            for i, t in enumerate(tensors):
                t[rows].copy_(kv[layer, i])

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Runs the batch (writing its KV) -> fp32 logits [S, V] of the rows that sample, on the CPU."""
        self._one_thread = False
        if self.device.type == "cpu":  # the fused execution path runs on the kernel's own pool
            small = batch.num_tokens <= SMALL_FORWARD_TOKENS or self.model.batch_invariant(batch.exact)
            want = 1 if small else self.max_threads
            if torch.get_num_threads() != want:
                torch.set_num_threads(want)
        try:
            hidden = self.model(batch, self.layer_caches)  # [T, H]
            self._hidden = hidden if self.keep_hidden else None
        except BaseException:
            self.experts.abort()  # no deferred work of this forward may land in the next one
            raise
        if batch.logits_rows.numel() == 0:
            return torch.empty(0, self.model.config.vocab_size)
        if (self.device.type == "cpu" and torch.get_num_threads() != self.max_threads
                and self.model.logits_on_torch(batch.exact)):
            # a torch lm_head streams [V, H]: worth every core. A compiled one has its own pool; raising
            # torch's here left its OpenMP workers spinning through the next decode step on the same cores
            # as the kernel (17% of decode samples on 2 cores).
            torch.set_num_threads(self.max_threads)
        rows = batch.logits_rows  # every row, in order, when as many as tokens (a decode step)
        return self.model.compute_logits(hidden if rows.numel() == hidden.shape[0] else hidden[rows],
                                         exact=batch.exact).cpu()

    def shutdown(self) -> None:
        self.experts.shutdown()
