"""Sequence: one request's tokens, KV blocks, decoding state and streamed text."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from engine.mode import Mode
from engine.sampling_params import SamplingParams
from engine.segments import SegmentTracker

_arrival = itertools.count()


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0  # tokens whose KV is in the cache
    block_table: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    arrival: int = field(default_factory=lambda: next(_arrival))
    num_preemptions: int = 0
    mode: Mode = Mode.EXPLORATION  # execution: exact profile, no deferral, batch-invariant
    mode_switches: list[tuple[int, Mode]] = field(default_factory=list)  # (output token index, new mode)
    generator: torch.Generator | None = None  # drafts' acceptance draws (engine/multi_token.py)
    # temperature sampling's race noise (engine/sampler.race_noise): the stream's key (the seed, else drawn from
    # torch's global generator at the first draw) and the draws made so far
    noise_key: int | None = None
    noise_draws: int = 0
    # Text: `text` is the detokenized output so far (stop strings cut off); `emitted` how much of it
    # has been handed to the caller (text that may still turn out to start a stop string is held back).
    text: str = ""
    emitted: int = 0
    detokenizer: object | None = None
    num_reported: int = 0  # output tokens already handed to the caller
    segments: SegmentTracker | None = None  # structured segments in the output (params.segments)
    # Speculative drafts after the output: computed with it in the next step, then verified
    # (engine/multi_token.py); part of `token_ids`, never of the output until accepted.
    draft_token_ids: list[int] = field(default_factory=list)
    # Prefix cache: root of the block hash chain (None: not cached), exact reuse (execution mode), the
    # chain's hashes so far, how many leading blocks are registered or came from the cache, and what the
    # latest admission found in the cache (tokens, blocks per tier: a dict replaced at admission, never changed in
    # place, so outputs hold it without a copy).
    cache_salt: str = ""
    cache_root: bytes | None = None
    cache_exact: bool = False
    block_hashes: list[str] = field(default_factory=list)
    num_cache_checked: int = 0
    num_cached_tokens: int = 0
    cache_hits: dict[str, int] = field(default_factory=dict)
    state_slot: int | None = None  # linear-attention models: the recurrent-state slot while running

    def __post_init__(self) -> None:
        self.mode = Mode.parse(self.mode)
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: empty prompt")
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)
            self.noise_key = self.params.seed

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + len(self.draft_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids + self.draft_token_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """token_ids[start:end], without joining the whole list when the span lies in the output (a decode)."""
        at = start - len(self.prompt_token_ids)
        if at >= 0 and end - start <= len(self.output_token_ids) - at:
            return self.output_token_ids[at:at + end - start]
        return self.token_ids[start:end]

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
