"""Continuous batching: chunked prefill and decode mixed under a token budget, recompute preemption.

Linear-attention models (Qwen3-Next) carry a recurrent state per sequence (engine/recurrent_state.py): a slot
is taken on admission and given back on finish, abort and preemption (the sequence is then recomputed), and
with prefix-cache snapshots a prompt's prefill stops once at its last full block so its state is saved there.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from engine.kv_cache import BlockManager
from engine.mode import Mode
from engine.recurrent_state import RecurrentStates
from engine.sequence import SeqStatus, Sequence


class PrefixMatcher(Protocol):
    def attach(self, seq: Sequence) -> None:
        """Fills an empty block table with cached prefix blocks and advances `num_computed` past them."""

    def detach(self, seq: Sequence) -> None:
        """Releases what `attach` took when the sequence cannot be admitted now."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError(f"scheduler limits must be >= 1: {self}")


class ScheduledChunk(NamedTuple):
    """One sequence's tokens computed in a step (a named tuple: built per sequence and step, at a quarter of a frozen
    dataclass's cost)."""

    seq: Sequence
    start: int  # first token position computed this step
    num_tokens: int
    samples: bool  # the chunk reaches the sequence's last token, so a next token is sampled
    num_logits: int = 0  # trailing rows with logits: 1 + the sequence's drafts when it samples

    @classmethod
    def of(cls, seq: Sequence, num_tokens: int) -> ScheduledChunk:
        start = seq.num_computed
        samples = start + num_tokens == seq.num_tokens
        return cls(seq, start, num_tokens, samples, 1 + len(seq.draft_token_ids) if samples else 0)


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager, prefix: PrefixMatcher | None = None,
                 states: RecurrentStates | None = None) -> None:
        self.config = config
        self.blocks = blocks
        self.prefix = prefix
        self.states = states
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in arrival order

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _chunk_len(self, seq: Sequence, budget: int) -> int:
        """Tokens to compute for `seq` this step.

        Execution sequences run alone in fixed chunks aligned to multiples of the step budget, so
        their chunking (and so their numerics) never depends on what else is running; they are
        not charged to the shared budget.
        """
        remaining = seq.num_tokens - seq.num_computed
        if seq.mode == Mode.EXECUTION:
            align = self.config.max_num_batched_tokens
            n = min(remaining, align - seq.num_computed % align)
        else:
            todo = remaining
            if self.states is not None and self.prefix is not None and seq.cache_root is not None:
                # the state at the prompt's last full block (the longest hit a request with this prompt can
                # take) is only saved if a forward ends there
                bs = self.blocks.block_size
                boundary = (len(seq.prompt_token_ids) - 1) // bs * bs
                if seq.num_computed < boundary:
                    todo = boundary - seq.num_computed
            n = min(todo, budget)
        if seq.draft_token_ids and n < remaining:  # drafts are verified in one chunk with their last token
            seq.draft_token_ids = []
            return self._chunk_len(seq, budget)
        return n

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        bs, i = self.blocks.block_size, 0
        while i < len(self.running):
            seq = self.running[i]
            start = seq.num_computed
            if (start < len(seq.block_table) * bs and not seq.draft_token_ids
                    and start + 1 == len(seq.prompt_token_ids) + len(seq.output_token_ids)
                    and (budget or seq.mode == Mode.EXECUTION)):
                # a decode whose block is allocated: what `_chunk_len` and the block checks below find for it (one
                # token, nothing to allocate, nobody preempted), without them
                chunks.append(ScheduledChunk(seq, start, 1, True, 1))
                budget -= 0 if seq.mode == Mode.EXECUTION else 1
                i += 1
                continue
            n = self._chunk_len(seq, budget)
            if n == 0:
                i += 1
                continue
            if seq.draft_token_ids and not self.blocks.can_allocate(
                    self.blocks.blocks_needed(seq.block_table, seq.num_computed + n)):
                seq.draft_token_ids = []  # drafts never preempt anyone
                n = self._chunk_len(seq, budget)
            while not self.blocks.can_allocate(self.blocks.blocks_needed(seq.block_table, seq.num_computed + n)):
                victim = self.running[-1]  # the latest arrival gives way
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break
            self.blocks.grow(seq.block_table, seq.num_computed + n)
            chunks.append(ScheduledChunk.of(seq, n))
            budget -= 0 if seq.mode == Mode.EXECUTION else n
            i += 1
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            attached = self.prefix is not None and not seq.block_table
            if attached:
                self.prefix.attach(seq)
            n = self._chunk_len(seq, budget)
            if n == 0 or not self.blocks.can_allocate(
                self.blocks.blocks_needed(seq.block_table, seq.num_computed + n)
            ):
                if attached:
                    self.prefix.detach(seq)
                break
            self.waiting.popleft()
            if self.states is not None:
                self.states.admit(seq)  # a slot, holding the prefix hit's snapshot if there is one
            self.blocks.grow(seq.block_table, seq.num_computed + n)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            chunks.append(ScheduledChunk.of(seq, n))
            budget -= 0 if seq.mode == Mode.EXECUTION else n
        return chunks

    def drop_kv(self, seq: Sequence) -> None:
        """Forgets a running sequence's KV so it is recomputed from its first token (resync)."""
        self.blocks.free(seq.block_table)
        seq.num_computed = seq.num_cache_checked = 0

    def _preempt(self, seq: Sequence) -> None:
        """Frees the sequence's KV; it goes back to the head of the queue and is recomputed."""
        self.running.remove(seq)
        self.blocks.free(seq.block_table)  # its registered blocks stay cached: readmission finds them
        seq.num_computed = seq.num_cache_checked = 0
        seq.draft_token_ids = []
        seq.num_preemptions += 1
        if self.states is not None:
            self.states.release(seq)  # recomputed on readmission (from a prefix-cache snapshot where one is kept)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        self.blocks.free(seq.block_table)
        if self.states is not None:
            self.states.release(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
