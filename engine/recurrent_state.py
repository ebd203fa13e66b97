"""Recurrent state of linear-attention layers (Qwen3-Next): one slot per running sequence, beside the KV cache.

A linear-attention layer keeps, per sequence, its causal-conv inputs [C, K-1] and its delta-rule state
[NV, DK, DV] (fp32) instead of KV for every token. The scheduler gives a sequence a slot when it is admitted
and takes it back when the sequence finishes, is aborted or is preempted (a preempted sequence is recomputed:
its state is rebuilt from token 0, or from a prefix-cache snapshot on readmission). A chunk that starts at
token 0 starts from zeros (engine/models/qwen3_next.py), so a slot needs no clearing.

Prefix cache: a KV hit is only usable with the state at its boundary. After a forward ends a sequence on a
block boundary whose block is registered, the slot is copied into a snapshot slot keyed by that block's chain
hash (LRU over `snapshots` slots); the prefix cache cuts each hit back to the longest prefix with a snapshot
(none: no hit), and admission restores it. Snapshots live in device memory only: a hit whose KV came back from
RAM, disk or redis still needs its snapshot here.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from engine.config import ModelConfig
from engine.sequence import Sequence


def layer_caches(cfg: ModelConfig, kv_caches: list[tuple[torch.Tensor, ...]],
                 states: RecurrentStates | None) -> list[tuple[torch.Tensor, ...]]:
    """What each layer's forward reads and writes, in layer order: its KV (`kv_caches`, one per `cfg.kv_layers`)
    or its recurrent-state pools."""
    kv = dict(zip(cfg.kv_layers, kv_caches, strict=True))
    return [kv[i] if i in kv else states.layers[i] for i in range(cfg.num_layers)]


class RecurrentStates:
    """Slot pools per linear-attention layer: `layers[i]` = (conv [S, C, K-1], delta [S, NV, DK, DV])."""

    def __init__(self, cfg: ModelConfig, max_seqs: int, snapshots: int, block_size: int,
                 device: torch.device | str) -> None:
        la = cfg.linear_attention
        n = max_seqs + snapshots
        self.block_size = block_size
        self.layers = {
            i: (torch.zeros(n, la.conv_dim, la.conv_kernel - 1, device=device),
                torch.zeros(n, la.num_value_heads, la.key_head_dim, la.value_head_dim, device=device))
            for i in cfg.linear_layers
        }
        self._free = list(range(max_seqs - 1, -1, -1))
        self._spare = list(range(n - 1, max_seqs - 1, -1))  # snapshot slots not in use
        self._snapshots: OrderedDict[str, int] = OrderedDict()  # block chain hash -> slot, LRU first

    @classmethod
    def build(cls, cfg: ModelConfig, max_seqs: int, snapshots: int | None, prefix_cache: bool, block_size: int,
              device: torch.device | str) -> RecurrentStates | None:
        """The pools of a model with linear-attention layers (None without them); `snapshots` None: one per
        running sequence with the prefix cache on, none without it."""
        if cfg.linear_attention is None:
            return None
        snapshots = snapshots if snapshots is not None else max_seqs if prefix_cache else 0
        return cls(cfg, max_seqs, snapshots, block_size, device)

    @property
    def num_snapshots(self) -> int:
        return len(self._snapshots)

    def longest_hit(self, hashes: list[str], blocks: int, step: int) -> int:
        """The most of the first `blocks` blocks (a multiple of `step`) at whose end a state snapshot is kept."""
        while blocks and hashes[blocks - 1] not in self._snapshots:
            blocks -= step
        return blocks

    def admit(self, seq: Sequence) -> None:
        """Gives an admitted sequence a slot, holding the snapshot at `num_computed` when a prefix hit left it there."""
        if seq.state_slot is None:
            if not self._free:
                raise RuntimeError("no free recurrent-state slot: more running sequences than max_num_seqs")
            seq.state_slot = self._free.pop()
        if seq.num_computed:
            key = seq.block_hashes[seq.num_computed // self.block_size - 1]
            self._copy(self._snapshots[key], seq.state_slot)
            self._snapshots.move_to_end(key)

    def release(self, seq: Sequence) -> None:
        if seq.state_slot is not None:
            self._free.append(seq.state_slot)
            seq.state_slot = None

    def save(self, seq: Sequence, key: str) -> None:
        """Snapshots the sequence's state (now at the end of the block hashed `key`) for prefix-cache hits."""
        if seq.state_slot is None:
            return
        if key in self._snapshots:
            self._snapshots.move_to_end(key)
            return
        if not self._spare:
            if not self._snapshots:
                return  # no snapshot slots: hits are refused for this model
            self._spare.append(self._snapshots.popitem(last=False)[1])
        slot = self._spare.pop()
        self._copy(seq.state_slot, slot)
        self._snapshots[key] = slot

    def _copy(self, src: int, dst: int) -> None:
        for conv, delta in self.layers.values():
            conv[dst].copy_(conv[src])
            delta[dst].copy_(delta[src])
