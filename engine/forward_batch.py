"""ForwardBatch: everything one forward pass needs, passed explicitly down the model."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from kernels.attention import causal_contexts

if TYPE_CHECKING:
    from engine.expert_pipeline import ExpertPipeline


@dataclass
class ForwardBatch:
    """A flat batch of T new tokens from B sequences (prefill chunks and decodes mixed).

    Tokens of sequence b occupy rows [query_starts[b], query_starts[b] + query_lens[b]).
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of each token in its sequence
    slot_mapping: torch.Tensor  # [T] int64, KV slot (block * block_size + offset) each token writes
    query_lens: list[int]  # [B] new tokens per sequence
    context_lens: list[int]  # [B] tokens in the KV cache for the sequence after this step
    context_slots: list[torch.Tensor]  # [B] x [context_len] int64, KV slots to attend over, in order
    logits_rows: torch.Tensor  # [S] rows of T whose next-token logits are wanted
    exact: bool = False  # execution mode: the exact precision profile, no deferral
    defer: int = 0  # exploration: experts per token deferred to the next MoE layer
    expert_pipeline: ExpertPipeline | None = None  # host experts; its thread runs deferred experts during the next attention
    state_slots: list[int] = field(default_factory=list)  # [B] recurrent-state slot per sequence (linear attention)
    rope: dict = field(default_factory=dict, repr=False)  # (head_dim, theta, dtype) -> (cos, sin), once per forward
    contexts: tuple | None = field(default=None, repr=False)  # token_contexts(), once per forward

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def query_starts(self) -> list[int]:
        starts, acc = [], 0
        for n in self.query_lens:
            starts.append(acc)
            acc += n
        return starts

    def token_contexts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(slots, start, length) int64 on the CPU: token t attends over slots[start[t] : start[t] + length[t]],
        its sequence's context up to and including itself (kernels.attention.causal_contexts)."""
        if self.contexts is None:
            self.contexts = causal_contexts(self.query_lens, self.context_lens, self.context_slots)
        return self.contexts

    def to(self, device: torch.device) -> ForwardBatch:
        return replace(
            self,
            input_ids=self.input_ids.to(device),
            positions=self.positions.to(device),
            slot_mapping=self.slot_mapping.to(device),
            context_slots=[s.to(device) for s in self.context_slots],
            logits_rows=self.logits_rows.to(device),
            rope={},
            contexts=None,
        )

    @classmethod
    def single(cls, token_ids: list[int], block_table: list[int], block_size: int, start: int = 0):
        """One sequence: tokens [start, start+len(token_ids)) written through `block_table`."""
        n = len(token_ids)
        positions = torch.arange(start, start + n)
        table = torch.tensor(block_table, dtype=torch.long)
        all_pos = torch.arange(start + n)
        slots = table[all_pos // block_size] * block_size + all_pos % block_size
        return cls(
            input_ids=torch.tensor(token_ids, dtype=torch.long),
            positions=positions,
            slot_mapping=slots[start:],
            query_lens=[n],
            context_lens=[start + n],
            context_slots=[slots],
            logits_rows=torch.arange(n),
            state_slots=[0],
        )
