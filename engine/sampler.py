"""Next-token choice per row: logits processors, then greedy or temperature / top-k / top-p sampling.

Temperature sampling is an exponential race (Gumbel-max): token = argmax(logits / T - log q), q ~ Exp(1)
per id, from the sequence's own noise stream (`race_noise`: kernels/race_noise.py, a counter-based draw keyed by
the seed, so a seeded request reproduces its tokens whatever runs beside it). So the token chosen under an
allowed-token mask is the first allowed id in descending score order, as greedy's is the first allowed id in
descending logit order (ties: lowest id first).

Mask processors (engine.sampling_params.MaskProcessor, e.g. constrained decoding) are batched: the
masks of every such row in a step come from one `MaskBatcher.masks` call and one `apply` over
those rows; after sampling, each is advanced by its new token and `prefetch` starts the next masks
in the background, so they are computed while the next forward pass runs. Where the batcher allows
it (`lazy_candidates` > 0) and the row's order alone decides (no top-k / top-p, no other processor),
the row's best candidates are checked one by one first (`first_allowed`); only a row where none of
them is ruled on gets its full mask, and samples from the same scores: the same token either way.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch

from engine.errors import EngineError
from engine.sampling_params import MIN_TEMPERATURE, MaskProcessor
from engine.sequence import Sequence


class SamplingError(EngineError):
    """No token could be chosen for one sequence (every token masked, a logits processor failed)."""


def apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] -> logits [V] with the tokens outside top-k / the top-p nucleus set to -inf."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= top_p  # keep the token that crosses top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def race_noise(width: int, seq: Sequence) -> torch.Tensor:
    """-log q, q ~ Exp(1), [width] fp32: the next draw of `seq`'s noise stream (kernels/race_noise.py: a function
    of the sequence's key and the number of draws before it, ~0.6-1 ms for a 152k vocabulary)."""
    from kernels.race_noise import race_noise as draw

    return draw(width, *next_draw(seq))


def next_draw(seq: Sequence) -> tuple[int, int]:
    """(key, counter) of `seq`'s next race draw, used up."""
    draw = coming_draw(seq)
    seq.noise_draws += 1
    return draw


def coming_draw(seq: Sequence) -> tuple[int, int]:
    """(key, counter) of `seq`'s next race draw, not used up (the fused decode step races in the lm_head's call)."""
    if seq.noise_key is None:
        seq.noise_key = int(torch.randint(0, 2**63 - 1, (1,)))  # unseeded: torch's global generator decides
    return seq.noise_key, seq.noise_draws


class HeadPicks:
    """Each logits row's pick found by the lm_head's call (engine/models/fused_step.py, kernels/bindings.py
    HeadRaceCall): `tokens` [S] int64, the plain greedy rows' first largest logit and the raced rows' race winner;
    `best` [S] fp32 the race's score; `draws[i]` the (key, counter) row i raced with, None where it did not race;
    `limit` the logits the races ran over. The sampler takes a raced row's pick where that draw is the sequence's
    next and the limit its own, else races the row's logits itself."""

    __slots__ = ("tokens", "best", "draws", "limit")

    def __init__(self, tokens: np.ndarray, best: np.ndarray, draws: list, limit: int) -> None:
        self.tokens, self.best, self.draws, self.limit = tokens, best, draws, limit


def skip_race_draw(seq: Sequence) -> None:
    """A token chosen without sampling (forced) still uses up the draw a temperature row would have made, so a
    seeded sequence's later tokens do not depend on which of its tokens were forced."""
    if seq.params.temperature >= MIN_TEMPERATURE:
        seq.noise_draws += 1


class LogitsView:
    """A step's logits [S, V] and what the sampler reads of them: rows, width and the numpy view of the same memory
    (None where it has none: not fp32 on the CPU). `MultiTokenDecoder` keeps the last one: the runner's fused decode
    step hands the same tensor (a view of its kept buffer) at every step, and right after the kernels each torch call
    on it costs 10-40 us (cold caches) where these attribute reads cost a few."""

    __slots__ = ("tensor", "rows", "width", "values")

    def __init__(self, logits: torch.Tensor) -> None:
        self.tensor = logits
        self.rows, self.width = logits.shape
        on_numpy = logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad
        self.values = logits.numpy() if on_numpy else None


def sample(
    logits: torch.Tensor, seqs: list[Sequence], vocab_limit: int | None = None,
    first_max: np.ndarray | HeadPicks | None = None, view: LogitsView | None = None,
) -> list[int | SamplingError]:
    """logits [S, V] fp32 (one row per sequence) -> a token id per sequence, or the error that
    sequence hit (it fails alone; the other rows are unaffected). first_max [S] int64: each row's first largest
    logit where the lm_head's call found it (engine/models/fused_decode.py), for the plain greedy rows; a HeadPicks:
    those and the plain temperature rows' races run there. `view`: the logits' LogitsView where the caller keeps one."""
    tokens: list[int | SamplingError | None] = [None] * len(seqs)
    view = view if view is not None else LogitsView(logits)
    races = first_max if isinstance(first_max, HeadPicks) else None
    if races is not None:
        first_max = races.tokens
    if _greedy_plain_rows(view, seqs, tokens, vocab_limit, first_max):
        return tokens  # type: ignore[return-value]  # every row was plain greedy: nothing written, no torch call
    if _race_plain_rows(view, seqs, tokens, vocab_limit, races):
        return tokens  # type: ignore[return-value]  # every row was plain (greedy or temperature): no torch call
    with torch.inference_mode():  # the vocabulary mask and the processors edit the rows in place (forward's: inference)
        if vocab_limit is not None and vocab_limit < logits.shape[-1]:
            logits[:, vocab_limit:] = float("-inf")  # padded rows of the embedding are not tokens
        noise = _lazy_rows(logits, seqs, tokens)
        groups = _apply_batched_masks(logits, seqs, skip=tokens)
        for i, (row, seq) in enumerate(zip(logits, seqs, strict=True)):
            if tokens[i] is not None:
                continue
            try:
                batched = any(i in rows for rows in groups.values())
                tokens[i] = sample_row(row, seq, batched=batched, noise=noise.get(i))
            except Exception as exc:  # noqa: BLE001 - a processor's failure belongs to its request
                tokens[i] = exc if isinstance(exc, SamplingError) else SamplingError(f"request {seq.request_id}: {exc}")
    _prefetch(groups, seqs, tokens)  # outside: a batcher's background thread fills the masks it allocates here in place
    return tokens  # type: ignore[return-value]  # every row is set above


def _batched(seq: Sequence) -> MaskProcessor | None:
    """The one batchable mask processor of `seq` (None when it has none, or more than one)."""
    procs = [p for p in seq.params.logits_processors if getattr(p, "mask_batcher", None) is not None
             and _is_mask_processor(p)]
    return procs[0] if len(procs) == 1 else None


def _is_mask_processor(proc) -> bool:
    """isinstance(proc, MaskProcessor) without the runtime Protocol check, which walks the protocol's
    attributes on every call (~0.1 ms, twice per constrained row and step)."""
    return callable(getattr(proc, "advance", None)) and callable(proc)


def _lazy_candidates(seq: Sequence) -> tuple[MaskProcessor, int] | None:
    """(processor, candidates to check) when the row's token may be found without its full mask: one mask
    processor, the only one, that can rule on single ids, under a batcher with `lazy_candidates`, and no
    top-k / top-p (they normalise over the allowed set)."""
    p = seq.params
    proc = _batched(seq)
    if proc is None or len(p.logits_processors) != 1 or not callable(getattr(proc, "first_allowed", None)):
        return None
    k = getattr(proc.mask_batcher, "lazy_candidates", 0)
    if not k or (p.temperature >= MIN_TEMPERATURE and (p.top_k or p.top_p < 1.0)):
        return None
    return proc, k


def _lazy_rows(logits: torch.Tensor, seqs: list[Sequence], tokens: list) -> dict[int, torch.Tensor]:
    """Set tokens[i] for the rows whose processor allows one of their best candidates, or whose processor's rules
    leave the row a few known ids (`known_row`: an ended output's EOS, a completion plan's token, the closing
    window's closers): the best of those; returns the race noise drawn for temperature rows that go on to the full
    mask (the same draw samples them there)."""
    noise: dict[int, torch.Tensor] = {}
    waited: set[int] = set()
    for i, seq in enumerate(seqs):
        if (lazy := _lazy_candidates(seq)) is None:
            continue
        proc, k = lazy
        row = logits[i]
        if seq.params.temperature >= MIN_TEMPERATURE:
            noise[i] = race_noise(row.shape[-1], seq)
            row = row / seq.params.temperature + noise[i]  # [V] race scores
        try:
            if id(proc.mask_batcher) not in waited:  # no prefetch may compute on a processor checked here
                waited.add(id(proc.mask_batcher))
                proc.mask_batcher.wait()
            proc.advance(seq.output_token_ids)
            if (known := getattr(proc, "known_row", None)) is not None and (ids := known()) is not None:
                token = best_of(row, ids)  # the rules left the row these ids: its mask's pick among them
                proc.count_lazy(token is not None)
            else:
                token = proc.first_allowed(ranked(row, k))
        except Exception:  # noqa: BLE001 - the full-mask path meets the failure again and keeps it to its row
            token = None
        if token is not None:
            tokens[i] = token
            noise.pop(i, None)
    return noise


def best_of(scores: torch.Tensor, ids) -> int | None:
    """The id greedy picks from scores [V] masked to `ids` (the highest, ties lowest id first), or None where that
    score is not finite (the full path then raises the row's error)."""
    s = scores.numpy() if scores.device.type == "cpu" and scores.dtype == torch.float32 else scores.float().cpu().numpy()
    order = np.unique(np.asarray(ids, dtype=np.int64))  # ascending: argmax's first max is the lowest id
    if not order.size or order[-1] >= s.shape[0]:
        return None
    at = int(order[int(np.argmax(s[order]))])
    return at if math.isfinite(float(s[at])) else None


def ranked(scores: torch.Tensor, k: int) -> Iterator[int]:
    """The first k ids of scores [V] in the order greedy ranks them (descending, ties lowest id first), cut at
    the first non-finite score (a NaN row yields nothing: greedy's pick is then no ranking's). The first is
    greedy's own pick (one pass over the row); the rest are ranked only when asked for."""
    s = scores.numpy() if scores.device.type == "cpu" and scores.dtype == torch.float32 else scores.float().cpu().numpy()
    first = int(np.argmax(s))  # (a NaN anywhere is the max)
    if not math.isfinite(float(s[first])):
        return
    yield first
    k = min(k, s.shape[0])
    ties = _top_ties(s, k)  # every id ranked within the first k, whatever the ties
    if ties.size > 4 * k:  # (a flat row: e.g. mostly -inf) nothing to gain over the full mask
        return
    for token in ties[np.lexsort((ties, -s[ties]))][1:k].tolist():
        if not math.isfinite(float(s[token])):
            return
        yield token


# ids grouped by their residue mod RANK_GROUPS for `_top_ties`: a column maximum over a [V / G, G] view is one
# vectorised pass (~40 us for 152k ids), where a partition of the whole row costs ~1-2 ms
RANK_GROUPS = 2048


def _top_ties(s: np.ndarray, k: int) -> np.ndarray:
    """The ids (ascending) whose score in s [V] (no NaN) is at least the k-th largest, found among the members of
    the k best groups of ids (every id of score >= the k-th largest lies in a group whose maximum is >= the k-th
    largest group maximum, which is <= the k-th largest score) and the ids past the last whole group; the whole
    row where many groups tie there."""
    n, g = s.shape[0], RANK_GROUPS
    cut = n - n % g
    if cut and k <= g:
        best = s[:cut].reshape(-1, g).max(axis=0)  # [G] the maximum of ids j, j + G, j + 2G, ...
        groups = np.flatnonzero(best >= np.partition(best, g - k)[g - k])
        if groups.size <= 4 * k:
            ids = np.concatenate(((np.arange(0, cut, g)[:, None] + groups).ravel(), np.arange(cut, n)))
            scores = s[ids]
            return np.sort(ids[scores >= np.partition(scores, ids.size - k)[ids.size - k]])
    return np.flatnonzero(s >= s[np.argpartition(-s, k - 1)[:k]].min())


def _apply_batched_masks(logits: torch.Tensor, seqs: list[Sequence], skip: list):
    """Mask the rows of batchable processors in place (not those with a token in `skip`), one batcher call
    each -> {batcher: {row: processor}}."""
    groups: dict[object, dict[int, MaskProcessor]] = {}
    for i, seq in enumerate(seqs):
        if skip[i] is None and (proc := _batched(seq)) is not None:
            groups.setdefault(proc.mask_batcher, {})[i] = proc
    words = (logits.shape[-1] + 31) // 32
    for batcher, members in list(groups.items()):
        rows = list(members)
        try:
            for i in rows:
                members[i].advance(seqs[i].output_token_ids)
            bitmask = batcher.masks([members[i] for i in rows], words)  # [n, W]
            for j, i in enumerate(rows):  # in place on row views: no gather / scatter copies of [n, V]
                batcher.apply(logits[i:i + 1], bitmask[j:j + 1])
        except Exception:  # noqa: BLE001 - these rows go row by row: a failure stays with its request
            del groups[batcher]
    return groups


def _prefetch(groups: dict, seqs: list[Sequence], tokens: list) -> None:
    """Advance each batched processor by its sampled token and start its next mask (rows that needed their
    full mask this step: a row its candidates decided is likely decided by them again)."""
    for batcher, members in groups.items():
        ready = []
        for i, proc in members.items():
            if isinstance(tokens[i], int):
                proc.advance([*seqs[i].output_token_ids, tokens[i]])
                ready.append(proc)
        if ready:
            batcher.prefetch(ready)


def greedy(row: torch.Tensor) -> int:
    """Index of the first largest logit of row [V]. On CPU through numpy: torch's CPU argmax is a
    scalar loop, ~240 us for a 152k-token row on a 2-core EPYC against ~17 us for numpy's."""
    if row.device.type == "cpu" and row.dtype == torch.float32:
        return int(np.argmax(row.numpy()))
    return int(torch.argmax(row))


def _greedy_plain_rows(view: LogitsView, seqs: list[Sequence], tokens: list, vocab_limit: int | None,
                       first_max: np.ndarray | None = None) -> bool:
    """Sets tokens[i] for the plain greedy rows (no logits processor, temperature below MIN_TEMPERATURE): the first
    largest of the row's first `vocab_limit` logits, read in place. The same id as `sample_row` on the
    vocabulary-masked row (the masked ids are -inf there: they win only when every id is -inf, and such a row
    fails either way), without writing the mask. first_max[i] given (the whole row's first largest): taken where
    it lies below the limit (then it is the limited row's first largest too), else the row is read. Returns
    whether every row was plain greedy."""
    limit = view.width if vocab_limit is None else min(vocab_limit, view.width)
    # [S, V] the same memory, one view for the batch: per row, a torch slice and index (`greedy`, `sample_row`)
    # cost ~15 us more than the argmax itself
    values, picks = view.values, first_max.tolist() if first_max is not None else None
    done = 0
    for i, seq in enumerate(seqs):
        if not seq.params.plain_greedy:
            continue
        token = picks[i] if picks is not None else limit
        if token >= limit:  # no pick from the forward, or one past the limit: the limited row is read
            token = int(values[i, :limit].argmax()) if values is not None else greedy(view.tensor[i, :limit])
        best = values.item(i, token) if values is not None else float(view.tensor[i, token])
        tokens[i] = token if math.isfinite(best) else SamplingError(
            f"request {seq.request_id}: no token is allowed at this step")
        done += 1
    return done == len(seqs)


def kernel_picks(view: LogitsView, seqs: list[Sequence], vocab_limit: int | None,
                 first_max: np.ndarray | HeadPicks) -> list[list[int]] | None:
    """[[token]] per row where every row is plain greedy and the forward's pick stands (first_max[i] below the
    vocabulary limit, its logit finite): `_greedy_plain_rows`' token for each, without its general loop; for a
    HeadPicks `head_picks`; else None (`sample` decides every row)."""
    values = view.values
    if values is None:
        return None
    limit = view.width if vocab_limit is None else min(vocab_limit, view.width)
    if isinstance(first_max, HeadPicks):
        return head_picks(first_max, values, seqs, limit)
    chosen = []
    for i, token in enumerate(first_max.tolist()):
        p = seqs[i].params
        if p.logits_processors or p.temperature >= MIN_TEMPERATURE or token >= limit or not math.isfinite(
                values.item(i, token)):
            return None
        chosen.append([token])
    return chosen


def head_picks(races: HeadPicks, values: np.ndarray, seqs: list[Sequence], limit: int) -> list[list[int]] | None:
    """[[token]] per row where every row is plain greedy or a plain race the lm_head's call ran with the row's next
    draw over `limit` logits, and each pick stands (its logit or score finite, the greedy pick below the limit): the
    tokens `_greedy_plain_rows` and `_race_plain_rows` take, each raced row's draw used up; else None, no draw used
    (`sample` decides every row)."""
    if races.limit != limit:
        return None
    tokens, best, draws, chosen = races.tokens.tolist(), races.best.tolist(), races.draws, []
    for i, seq in enumerate(seqs):
        p, token = seq.params, tokens[i]
        if draws[i] is not None:
            if not p.plain_race or draws[i] != coming_draw(seq) or not math.isfinite(best[i]):
                return None
        elif not p.plain_greedy or not 0 <= token < limit or not math.isfinite(values.item(i, token)):
            return None
        chosen.append([token])
    for i, seq in enumerate(seqs):
        if draws[i] is not None:
            seq.noise_draws += 1  # `next_draw`: the raced row's draw used up
    return chosen


def _race_plain_rows(view: LogitsView, seqs: list[Sequence], tokens: list, vocab_limit: int | None,
                     races: HeadPicks | None = None) -> bool:
    """Sets tokens[i] for the plain temperature rows (no logits processor, no top-k / top-p) of fp32 CPU logits: the
    race over the row's first `vocab_limit` logits in one kernel call, read in place (`sample_row`'s token: the
    masked ids are -inf there and win only where every id is -inf, and such a row fails either way), or the race the
    lm_head's call ran (`races`) where it drew the row's next draw over the same logits (the same id and score).
    Returns whether every row now has its token."""
    if view.values is None:
        return False
    from kernels.race_noise import race_sample

    limit = view.width if vocab_limit is None else min(vocab_limit, view.width)
    done, draws = True, races.draws if races is not None and races.limit == limit else None
    for i, seq in enumerate(seqs):
        p = seq.params
        if tokens[i] is not None:
            continue
        if not p.plain_race:
            done = False
            continue
        draw = next_draw(seq)
        if draws is not None and draws[i] == draw:
            token, best = races.tokens.item(i), races.best.item(i)  # type: ignore[union-attr]
        else:
            token, best = race_sample(view.values[i, :limit], p.temperature, *draw)
        tokens[i] = token if math.isfinite(best) else SamplingError(
            f"request {seq.request_id}: no token is allowed at this step")
    return done


def sample_row(row: torch.Tensor, seq: Sequence, batched: bool = False, noise: torch.Tensor | None = None) -> int:
    """logits row [V] -> the next token of `seq` under its SamplingParams (`batched`: its mask
    processor was already applied by `sample`; `noise`: this step's race noise, when already drawn)."""
    p = seq.params
    skip = _batched(seq) if batched else None
    for proc in p.logits_processors:
        if proc is not skip:
            row = proc(seq.output_token_ids, row)
    if p.temperature < MIN_TEMPERATURE:
        token = greedy(row)
        if not math.isfinite(float(row[token])):
            raise SamplingError(f"request {seq.request_id}: no token is allowed at this step")
        return token
    plain = not (p.top_k or p.top_p < 1.0) and row.device.type == "cpu" and row.dtype == torch.float32
    if plain and noise is None and row.is_contiguous():
        # the whole race in one kernel call (kernels/race_noise.py `race_sample`): numpy's pick below, bit for bit,
        # drawing the noise only of ids that can still win
        from kernels.race_noise import race_sample

        token, best = race_sample(row.numpy(), p.temperature, *next_draw(seq))
        if not math.isfinite(best):  # all -inf (every token masked), a +inf or a NaN
            raise SamplingError(f"request {seq.request_id}: no token is allowed at this step")
        return token
    if noise is None:
        noise = race_noise(row.shape[-1], seq)
    if plain:
        # the same operations in numpy on one scratch row (torch's fp32 division and addition give numpy's bits):
        # ~0.1 ms for 152k ids where the torch ops and the max check cost ~1 ms
        scores = np.divide(row.numpy(), np.float32(p.temperature))
        scores += noise.numpy()
        token = int(np.argmax(scores))  # the first largest, as `greedy`; a NaN wins and fails the check
        if not math.isfinite(scores.item(token)):  # all -inf (every token masked), a +inf or a NaN
            raise SamplingError(f"request {seq.request_id}: no token is allowed at this step")
        return token
    row = apply_top_k_top_p(row / p.temperature, p.top_k, p.top_p)
    if not math.isfinite(float(row.max())):  # all -inf (every token masked) or a NaN
        raise SamplingError(f"request {seq.request_id}: no token is allowed at this step")
    return greedy(row + noise)
