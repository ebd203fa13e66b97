"""Per-request decoding settings."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from engine.mode import Mode
from engine.segments import SegmentRules

# A logits processor sees the tokens generated so far for its sequence and that sequence's
# logits row [V]; it returns the (possibly masked) row. Constrained decoding plugs in here.
LogitsProcessor = Callable[[Sequence[int], torch.Tensor], torch.Tensor]

# Temperatures below this sample like greedy: only the top token survives, and dividing by them overflows fp32.
# The one threshold of the engine's sampler and of the gateway's requests.
MIN_TEMPERATURE = 1e-4


class LogitsRecorder:
    """A logits processor that keeps a copy of every row it sees (evals and tests of the numerics)."""

    def __init__(self) -> None:
        self.rows: list[torch.Tensor] = []

    def __call__(self, generated: Sequence[int], row: torch.Tensor) -> torch.Tensor:
        self.rows.append(row.clone())
        return row

    def bytes(self) -> bytes:
        return b"".join(r.numpy().tobytes() for r in self.rows)


class MaskBatcher(Protocol):
    """Fills the allowed-token bitmasks of many MaskProcessors at once (see engine/sampler.py)."""

    def masks(self, processors: list, words: int) -> torch.Tensor:
        """[n, words] int32 bitmask (bit j of word w allows id 32w+j), one row per processor."""

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        """Mask logits [n, V] in place with bitmask [n, ceil(V/32)]."""

    def prefetch(self, processors: list) -> None:
        """Start computing the next masks in the background (the processors were just advanced)."""

    def wait(self) -> None:
        """Join the background mask computations in flight (before a processor is used outside them)."""

    # Optional (engine/sampler.py): > 0 lets the sampler check a row's best candidates one by one through the
    # processor's `first_allowed(ids) -> id | None` before its full mask; 0 (or absent): every row's full mask.
    lazy_candidates: int

    def forced_tokens(self, items: list) -> list[int | None]:
        """Optional (jump-forward, engine/multi_token.py): for (processor, generated ids) pairs, each processor's
        `forced_token(ids)`, the masks computed together."""


@runtime_checkable
class MaskProcessor(Protocol):
    """A logits processor whose whole effect is an allowed-token mask: the sampler advances it by
    the sampled ids and masks every such row of a step through its `mask_batcher` in one call, then
    starts the next step's masks while the forward pass runs. Still callable per row."""

    mask_batcher: MaskBatcher | None

    def advance(self, token_ids: Sequence[int]) -> None: ...

    def __call__(self, token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor: ...


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logits_processors: list[LogitsProcessor] = field(default_factory=list)
    # Mode switches inside the step that samples a token, so the next token is computed in the new mode.
    # `mode_triggers`: sampling one of these token ids switches to the mapped mode, e.g. {<tool_call>:
    # execution, </tool_call>: exploration}. `segments`: structured segments (tool calls, ```json / ```sql
    # fences) detected on the sampled tokens, each masked by its own constraint, reported as segment events
    # (engine/segments.py). `resync` applies to switches into execution: "recompute" recomputes the KV
    # strictly (the segment then equals an all-execution run from the same prefix), "keep" reuses it.
    mode_triggers: dict[int, Mode] = field(default_factory=dict)
    segments: SegmentRules | None = None
    resync: str = "keep"

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.resync not in ("keep", "recompute"):
            raise ValueError(f"resync must be keep or recompute, got {self.resync!r}")
        self.mode_triggers = {t: Mode.parse(m, "mode_triggers values") for t, m in self.mode_triggers.items()}
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def plain_greedy(self) -> bool:
        """The sampler takes the row's first largest logit as it stands: no logits processor, temperature below
        MIN_TEMPERATURE (`sampler._greedy_plain_rows`; the fused decode step's in-kernel pick)."""
        return not self.logits_processors and self.temperature < MIN_TEMPERATURE

    @property
    def plain_race(self) -> bool:
        """The sampler's race reads the row as it stands: no logits processor, temperature at least MIN_TEMPERATURE,
        no top-k / top-p (`sampler._race_plain_rows`; the fused decode step's race in the lm_head's call)."""
        return not self.logits_processors and self.temperature >= MIN_TEMPERATURE and not self.top_k and self.top_p >= 1
