"""Multi-token decoding: a sequence feeds k > 1 tokens in one step and keeps a prefix of them.

Two sources of those tokens share one mechanism (a chunk of k tokens whose KV is computed together, with
logits at the rows that need them):

- Jump-forward: in constrained output the grammar often allows exactly one token (JSON keys, punctuation,
  SQL keywords). Those forced tokens are appended right after the sampled token without a forward each;
  the next step computes their KV as one chunk. Only where the numerics are chunk-invariant (the fused
  execution path), so the bytes equal token-by-token decoding; a seeded generator draws what sampling the
  forced token would have drawn, so sampled output is unchanged too.
- Prompt lookup (n-gram) speculation: the last n tokens are searched for earlier in prompt + output and
  the k tokens that followed become drafts. The next step computes the last token and the drafts in one
  chunk with logits at every row; the target's choice at each row verifies the next draft. Greedy keeps the
  longest agreeing prefix; sampling accepts a draft d with probability p(d) and otherwise samples from p
  with d removed, which leaves the output distribution unchanged (the drafts are deterministic, q(d) = 1).
  Rejected drafts' KV is rolled back (their slots are overwritten when those positions are recomputed).
  With `draft_source` "mtp" the drafts come from the checkpoint's multi-token-prediction layer instead
  (engine/mtp.py: `observe` after each step, `propose`), verified the same way.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.mode import Mode
from engine.sampler import (
    HeadPicks,
    LogitsView,
    SamplingError,
    apply_top_k_top_p,
    greedy,
    kernel_picks,
    sample,
    skip_race_draw,
)
from engine.sampling_params import MIN_TEMPERATURE
from engine.sequence import Sequence

log = logging.getLogger(__name__)

DRAFT_SOURCES = ("ngram", "mtp")


@dataclass(frozen=True)
class MultiTokenConfig:
    """jump_forward_tokens: forced tokens appended per step at most (0: off). speculative_tokens: drafts per
    step (0: off) from `draft_source`: "ngram" (matching the last ngram_max..ngram_min tokens) or "mtp" (the
    checkpoint's multi-token-prediction layer, engine/mtp.py)."""

    jump_forward_tokens: int = 0
    speculative_tokens: int = 0
    ngram_max: int = 3
    ngram_min: int = 1
    draft_source: str = "ngram"

    def __post_init__(self) -> None:
        if self.jump_forward_tokens < 0 or self.speculative_tokens < 0:
            raise ValueError(f"jump_forward_tokens and speculative_tokens must be >= 0: {self}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if self.draft_source not in DRAFT_SOURCES:
            raise ValueError(f"draft_source must be one of {', '.join(DRAFT_SOURCES)}, got {self.draft_source!r}")

    @property
    def mtp(self) -> bool:
        """Whether drafts come from the checkpoint's multi-token-prediction layer (which is then loaded)."""
        return self.speculative_tokens > 0 and self.draft_source == "mtp"


@dataclass
class MultiTokenStats:
    forced_tokens: int = 0  # tokens appended by jump-forward
    sampled_tokens: int = 0  # tokens chosen from logits (sampled, or accepted / corrected drafts)
    drafted_tokens: int = 0
    accepted_tokens: int = 0  # drafts the target agreed with

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


def propose_ngram(tokens: list[int], k: int, n_max: int, n_min: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the last n tokens (longest n first)."""
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + k]
    return []


def accept_drafts(rows: torch.Tensor, drafts: list[int], seq: Sequence) -> list[int]:
    """rows [k+1, V] (vocab-masked logits after the last token and after each draft) -> the accepted drafts
    plus one token chosen by the target (the correction, or the token after the last draft)."""
    p = seq.params
    if p.temperature < MIN_TEMPERATURE:
        out = []
        for row, draft in zip(rows, drafts, strict=False):
            token = greedy(row)
            out.append(token)
            if token != draft:
                return out
        return [*out, greedy(rows[len(drafts)])]
    out = []
    for row, draft in zip(rows, drafts, strict=False):
        probs = _probs(row, seq)
        u = float(torch.rand(1, generator=seq.generator))
        if u < float(probs[draft]):
            out.append(draft)
            continue
        probs[draft] = 0.0  # the residual max(0, p - q) with q the draft's one-hot distribution
        return [*out, int(torch.multinomial(probs, 1, generator=seq.generator))]
    return [*out, int(torch.multinomial(_probs(rows[len(drafts)], seq), 1, generator=seq.generator))]


def _probs(row: torch.Tensor, seq: Sequence) -> torch.Tensor:
    probs = torch.softmax(apply_top_k_top_p(row / seq.params.temperature, seq.params.top_k, seq.params.top_p), -1)
    if torch.isnan(probs).any() or not probs.sum() > 0:
        raise SamplingError(f"request {seq.request_id}: no token is allowed at this step")
    return probs


class MultiTokenDecoder:
    """Chooses each sampling sequence's next tokens from a step's logits and extends sequences between steps:
    forced tokens (jump-forward) or drafts (speculation). `chunk_invariant`: execution chunks compute each
    row independently of the chunk (the fused execution path), which jump-forward needs."""

    def __init__(self, config: MultiTokenConfig, chunk_invariant: bool, rollback: bool = True, drafter=None) -> None:
        if config.speculative_tokens and not rollback:
            # rejected drafts cannot be taken back out of a recurrent state (linear attention): KV only rolls back
            log.warning("speculative decoding is off: this model's linear-attention layers carry a recurrent "
                        "state that rejected drafts would change")
            config = dataclasses.replace(config, speculative_tokens=0)
        self.config = config
        # whether `observe` / `extend` can do anything: the step skips both where neither source is on
        self.extends = bool(config.jump_forward_tokens or config.speculative_tokens)
        self.chunk_invariant = chunk_invariant
        self.drafter = drafter  # draft_source "mtp": engine.mtp.MtpDrafter (`observe` each step, `propose`)
        self.stats = MultiTokenStats()
        self._view: LogitsView | None = None  # the last step's logits, read again while the runner hands the same


    def choose(self, logits: torch.Tensor, seqs: list[Sequence], vocab_limit: int | None,
               first_max: np.ndarray | HeadPicks | None = None) -> list[list[int] | SamplingError]:
        """logits [sum of 1 + drafts per seq, V] -> the tokens each sequence keeps this step. Drafts are
        verified here: rejected ones leave the sequence and its computed KV is rolled back before them.
        first_max [rows]: each row's first largest logit, where the forward found it, or the HeadPicks of the
        lm_head's races (`sampler.sample`)."""
        if not seqs:
            return []
        view = self._view
        if view is None or view.tensor is not logits:
            view = self._view = LogitsView(logits)
        if len(seqs) == view.rows:  # one row per sequence: no drafts anywhere, every row samples as it is
            if first_max is not None and (picked := kernel_picks(view, seqs, vocab_limit, first_max)) is not None:
                self.stats.sampled_tokens += len(picked)  # every row plain greedy: the forward's picks stand
                return picked  # type: ignore[return-value]
            chosen: list[list[int] | SamplingError] = []
            sampled = 0
            for t in sample(logits, seqs, vocab_limit, first_max, view):
                if isinstance(t, SamplingError):
                    chosen.append(t)
                else:
                    chosen.append([t])
                    sampled += 1
            self.stats.sampled_tokens += sampled
            return chosen
        counts = [1 + len(s.draft_token_ids) for s in seqs]
        firsts = list(itertools.accumulate(counts, initial=0))[:-1]  # each sequence's first row
        plain = [i for i, s in enumerate(seqs) if not s.draft_token_ids]
        picks: list[list[int] | SamplingError] = [[] for _ in seqs]
        if plain:  # without drafts anywhere the rows are the plain rows: no gather copy of [S, V]
            every = len(plain) == logits.shape[0]
            rows = logits if every else logits[torch.tensor([firsts[i] for i in plain])]
            picked = sample(rows, [seqs[i] for i in plain], vocab_limit, first_max if every else None)
            for i, token in zip(plain, picked, strict=True):
                picks[i] = token if isinstance(token, SamplingError) else [token]
        with torch.inference_mode():  # the vocabulary mask is written into the (forward's inference-mode) rows
            for i, seq in enumerate(seqs):
                if not seq.draft_token_ids:
                    continue
                drafts, seq.draft_token_ids = seq.draft_token_ids, []
                if vocab_limit is not None and vocab_limit < logits.shape[-1]:
                    logits[firsts[i]:firsts[i] + counts[i], vocab_limit:] = float("-inf")  # not tokens
                try:
                    picks[i] = accept_drafts(logits[firsts[i]:firsts[i] + counts[i]], drafts, seq)
                except SamplingError as e:
                    picks[i] = e
                    continue
                accepted = len(picks[i]) - 1
                seq.num_computed -= len(drafts) - accepted  # the rejected drafts' KV is not the sequence's
                self.stats.drafted_tokens += len(drafts)
                self.stats.accepted_tokens += accepted
        self.stats.sampled_tokens += sum(len(p) for p in picks if isinstance(p, list))
        return picks

    def extend(self, seqs: list[Sequence], advance: Callable[[Sequence, int], str | None]) -> dict[str, str]:
        """After `seqs` took this step's tokens: appends forced tokens (each through `advance`, as if sampled) or
        sets drafts for the next step. Forced tokens go in rounds, one per forcing sequence, their masks found
        together (a mask batcher's `forced_tokens`: one batched fill per round). Returns {request id: finish
        reason} for the sequences a forced token finished."""
        c, reasons, forcing = self.config, {}, []
        for seq in seqs:
            forced = self._forced_source(seq) if c.jump_forward_tokens and seq.params.logits_processors else None
            if forced is not None:
                forcing.append((seq, forced))
            elif c.speculative_tokens and self._speculates(seq):
                room = seq.params.max_tokens - len(seq.output_token_ids) - 1  # the verified step adds one more
                k = min(c.speculative_tokens, room)
                if k > 0:
                    seq.draft_token_ids = self._propose(seq, k)
        for _ in range(c.jump_forward_tokens):
            if not forcing:
                break
            going = []
            for (seq, source), token in zip(forcing, _forced_tokens(forcing), strict=True):
                if token is None:
                    continue
                skip_race_draw(seq)
                seq.output_token_ids.append(token)
                self.stats.forced_tokens += 1
                reason = advance(seq, token)
                if reason is not None:
                    reasons[seq.request_id] = reason
                else:
                    going.append((seq, source))
            forcing = going
        return reasons

    def observe(self, chunks: list, hidden: list[torch.Tensor] | None, going: list[Sequence]) -> None:
        """After the step's tokens are appended, before `extend`: the drafter reads the step's final hidden states
        (`ModelRunner.hidden`, one [num_tokens, H] per chunk) of the sequences that draft."""
        if self.drafter is None or hidden is None or not self.config.speculative_tokens:
            return
        live = {id(s) for s in going}
        self.drafter.observe(chunks, hidden, {id(c.seq) for c in chunks if self._speculates(c.seq)
                                              and (id(c.seq) in live or not c.samples)})

    def _propose(self, seq: Sequence, k: int) -> list[int]:
        if self.drafter is not None:
            return self.drafter.propose(seq, k)
        c = self.config
        return propose_ngram(seq.token_ids, k, c.ngram_max, c.ngram_min)

    def _forced_source(self, seq: Sequence):
        """The sequence's one mask processor when it can report forced tokens and the tokens' KV may be computed
        in one chunk without changing a byte; else None."""
        procs = seq.params.logits_processors
        if not (self.chunk_invariant and seq.mode == Mode.EXECUTION and len(procs) == 1
                and not seq.params.mode_triggers):  # a token computes its KV in the mode it switches to
            return None
        return procs[0] if callable(getattr(procs[0], "forced_token", None)) else None

    @staticmethod
    def _speculates(seq: Sequence) -> bool:
        """Only unconstrained sequences that cannot switch modes draft, and in execution mode only greedy ones (a
        seeded execution sequence must draw the same random numbers whatever the engine's settings)."""
        if seq.params.logits_processors or seq.segments is not None or seq.params.mode_triggers:
            return False
        return seq.mode != Mode.EXECUTION or seq.params.temperature < MIN_TEMPERATURE


def _forced_tokens(forcing: list[tuple[Sequence, object]]) -> list[int | None]:
    """Each (sequence, forced source)'s next forced token: sources that share a mask batcher with
    `forced_tokens` in one call per batcher, the others one by one."""
    out: list[int | None] = [None] * len(forcing)
    groups: dict[int, list[int]] = {}
    for i, (_, source) in enumerate(forcing):
        batcher = getattr(source, "mask_batcher", None)
        if callable(getattr(batcher, "forced_tokens", None)):
            groups.setdefault(id(batcher), []).append(i)
        else:
            out[i] = source.forced_token(forcing[i][0].output_token_ids)
    for rows in groups.values():
        batcher = forcing[rows[0]][1].mask_batcher
        tokens = batcher.forced_tokens([(forcing[i][1], forcing[i][0].output_token_ids) for i in rows])
        for i, token in zip(rows, tokens, strict=True):
            out[i] = token
    return out

