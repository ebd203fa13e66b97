"""A compiled constraint bound to one sequence: a logits processor plus the batched mask path."""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import numpy as np
import torch

from .base import CompiledConstraint, ConstraintKind
from .bitmask import apply_bitmask_, bitmask_words, ids_to_row, only_id
from .closing import KNOWN_SUFFIXES, completion_hints, digest, shared_path, shortest_completion
from .json_numbers import FiniteNumberGuard
from .sql_guard import SQLScopeGuard
from .vocab import TokenizerInfo

# Tokens that close an open construct, by preference tier (bytes allowed, required first byte);
# when the token budget is nearly spent the first tier with an allowed token wins: a quote that
# ends a JSON string, then JSON closers, then SQL's, then a separator (ends a number or value
# when required members remain).
CLOSING_TIERS = ((b'"}]', b'"'), (b'"}]', b""), (b")'", b"'"), (b")'", b""), (b",", b","))
# SQL: only what ends the open string or quoted name (its closing quote, then `)`s), then `)`s alone.
# `"` and `,` close nothing there: outside quotes they open a string or quoted name and a new item.
SQL_CLOSING_TIERS = {mode: ((b")" + mode.encode(), mode.encode()),) for mode in ("'", '"', "`", "]")}
SQL_PAREN_TIER = (b")", b")")
# Seconds of completion searches one output may spend once a search has failed: an output that wrote itself past
# what its budget can close (SQL names that only long FROM items could bind) would otherwise search again every few
# tokens of the closing window, seconds each; past it the closing tiers alone end the output (validation decides)
PLAN_SEARCH_LIMIT_S = 1.0


@functools.lru_cache(maxsize=8)
def _whitespace_ids(tokenizer: TokenizerInfo) -> tuple[int, ...]:
    return tuple(i for i, b in enumerate(tokenizer.token_bytes) if b and not b.strip())


@functools.lru_cache(maxsize=16)
def _closer_ids(tokenizer: TokenizerInfo, closing: bytes, first: bytes) -> tuple[int, ...]:
    allowed = set(closing)
    return tuple(i for i, b in enumerate(tokenizer.token_bytes)
                 if b and set(b) <= allowed and b.startswith(first))


@functools.lru_cache(maxsize=64)
def _hints(spec) -> tuple[bytes, ...]:
    return completion_hints(spec.source)


@functools.lru_cache(maxsize=8)
def _witness_ids(tokenizer: TokenizerInfo) -> tuple[int, ...]:
    """The one-byte tokens ";", " " and newline: after almost any text one of them may follow, so one the grammar
    allows and the guard keeps shows that a row is no dead end (Constraint._guard_leaves_some)."""
    return tuple(i for i, b in enumerate(tokenizer.token_bytes) if b in (b";", b" ", b"\n"))


@functools.lru_cache(maxsize=32)
def _special_rows(tokenizer: TokenizerInfo, eos_ids: tuple[int, ...], n_words: int):
    """(EOS row, closing tiers, whitespace row) as uint32 [n_words] bitmask rows; shared, read-only."""
    tiers = [ids_to_row(_closer_ids(tokenizer, c, f), n_words) for c, f in CLOSING_TIERS]
    rows = (ids_to_row(eos_ids, n_words), tiers, ids_to_row(_whitespace_ids(tokenizer), n_words))
    for row in (rows[0], *tiers, rows[2]):
        row.flags.writeable = False
    return rows


def _sql_tiers(mode: str) -> tuple[tuple[bytes, bytes], ...]:
    """SQL's closing tiers inside `mode` (the scope tracker's open quote: its closing char, "" outside quotes)."""
    return (*SQL_CLOSING_TIERS.get(mode, ()), SQL_PAREN_TIER) if mode else (SQL_PAREN_TIER,)


@functools.lru_cache(maxsize=32)
def _sql_closer_rows(tokenizer: TokenizerInfo, mode: str, n_words: int) -> tuple[np.ndarray, ...]:
    """SQL's closing tiers inside `mode` as read-only bitmask rows."""
    rows = tuple(ids_to_row(_closer_ids(tokenizer, c, f), n_words) for c, f in _sql_tiers(mode))
    for row in rows:
        row.flags.writeable = False
    return rows


def _validation_end_check(compiled: CompiledConstraint):
    """For a whole-output JSON Schema whose grammar admits a superset (keywords that validation decides): a
    check of a complete output's bytes against the caller's schema; None where the grammar decides alone."""
    spec, enforcement = compiled.spec, getattr(compiled, "enforcement", None)
    if (spec.kind is not ConstraintKind.JSON_SCHEMA or spec.envelope or enforcement is None
            or not enforcement.needs_validation()):
        return None
    from .errors import StructuredValidationError
    from .validate import validate_json

    def accepts(text: bytes) -> bool:
        try:
            validate_json(text.decode("utf-8", "replace"), spec.source)
        except StructuredValidationError:
            return False
        return True
    return accepts


class Constraint:
    """Per-sequence constraint state. Callable as an engine logits processor.

    EOS ids are allowed only when the constraint accepts; once it is terminated only EOS is.
    Whitespace is bounded: after `max_whitespace_run` consecutive whitespace bytes, whitespace-only
    tokens are masked out (so a grammar with free whitespace cannot loop on it). With `max_tokens`,
    the last `closing_window` steps prefer closing tokens (CLOSING_TIERS) and EOS as soon as the
    output is complete. Throughout (llguidance), the Constraint measures a completion path at adaptive
    intervals (a quarter of the way to the step where it must start): a suffix of the last path found
    where one still closes the output and leaves room, else closing.shortest_completion (shared by
    equal states: closing.shared_path), and, once the budget left is no more than the path plus EOS
    plus `closing_margin` (or at the first path found inside the closing window), forces that path
    token by token, so output that can close inside the budget does.
    """

    def __init__(
        self,
        compiled: CompiledConstraint,
        eos_ids: Sequence[int] | None = None,
        max_tokens: int | None = None,
        closing_window: int = 32,
        max_whitespace_run: int = 8,
        closing_margin: int = 4,
        mask_batcher=None,
    ) -> None:
        self.compiled = compiled
        self.matcher = compiled.new_matcher()
        tok = compiled.tokenizer
        self.eos_ids = tuple(eos_ids if eos_ids is not None else tok.eos_ids)
        self.max_tokens, self.closing_window = max_tokens, closing_window
        self.max_whitespace_run = max_whitespace_run
        self.closing_margin = closing_margin
        # The engine batches this row's mask through it (engine.sampling_params.MaskProcessor).
        self.mask_batcher = mask_batcher
        # SQL: binds aliases and table qualifiers to FROM while decoding (sql_scope.py tracks scopes, sql_guard.py filters tokens)
        # JSON Schema and tool calls: keeps every number a finite double (json_numbers.py)
        self.guard_fallbacks = 0  # dead ends: the guard vetoed every token (the sequence ends with an error)
        self.guard = (SQLScopeGuard.from_grammar(compiled.spec.source, tok, max_tokens)  # (new names within the budget)
                      if compiled.spec.kind is ConstraintKind.SQL
                      else FiniteNumberGuard(tok, compiled.spec.json_starts or ())
                      if compiled.spec.kind is ConstraintKind.JSON_SCHEMA
                      else FiniteNumberGuard(tok, compiled.spec.json_starts)
                      if compiled.spec.kind is ConstraintKind.TOOL_CALLS and compiled.spec.json_starts is not None
                      else None)
        # JSON Schema keywords that validation decides (oneOf overlap, uniqueItems, `not`...): a path the planner
        # forces must also be an output validation accepts, else the strict retry would close the same way
        self._end_check = _validation_end_check(compiled)
        self.plan: list[int] | None = None  # the forced completion path, once committed
        self._next_plan_check = 0  # consumed count at which the completion path is measured again
        self._output: list[int] = []  # the ids the matcher consumed (the completion search's state)
        self._last_path: tuple[int, ...] | None = None  # the completion path last found
        # the closing planner: searches run, checks answered by the last path, seconds in searches
        self.plan_searches = self.plan_reuses = 0
        self.plan_search_s = 0.0
        self.plan_failures = 0  # checks whose search found no path that fits
        self._token_bytes = tok.token_bytes
        self._ws_run = 0  # trailing whitespace bytes of the output so far
        self.vocab_size = tok.vocab_size
        self.tok_words = bitmask_words(tok.vocab_size)
        self._scratch: torch.Tensor | None = None
        self._peeked: tuple[int, torch.Tensor] | None = None  # (consumed, [1, tok_words] mask) of forced_token
        self._tiers: tuple[int, list[tuple[int, ...]] | None] | None = None  # (consumed, `_tier_ids`) last found
        self.consumed = 0
        self.ended = False  # an EOS id was consumed
        self.error = ""
        # the sampler's lazy path (first_allowed): steps decided by a candidate, candidates checked,
        # steps that needed the full mask
        self.lazy_hits = self.lazy_checked = self.lazy_fallbacks = 0

    # -- state -----------------------------------------------------------------------------
    def advance(self, token_ids: Sequence[int]) -> None:
        """Consume the ids generated since the last call (the engine passes all generated ids)."""
        for token in token_ids[self.consumed:]:
            self.consume(int(token))

    def consume(self, token: int) -> bool:
        self.consumed += 1
        if self.ended or self.error:
            self.error = self.error or f"token {token} after the end of the constrained output"
            return False
        if token in self.eos_ids:
            if not self._matcher_accepts():
                self.error = f"EOS {token} before the output was complete"
            self.ended = True
            return not self.error
        if self.plan is not None:
            self.plan = self.plan[1:] if self.plan and self.plan[0] == token else None
        if not self.matcher.consume(token):
            self.error = self.matcher.error() or f"token {token} not allowed"
            return False
        self._output.append(token)
        if self.guard is not None:
            self.guard.consume(token)
        piece = self._token_bytes[token] if token < len(self._token_bytes) else None
        if piece:
            stripped = piece.rstrip()
            self._ws_run = self._ws_run + len(piece) if not stripped else len(piece) - len(stripped)
        return True

    def _matcher_accepts(self) -> bool:
        return self.matcher.is_accepting() and (self.guard is None or self.guard.allows_end())

    def is_accepting(self) -> bool:
        return not self.error and (self.ended or self._matcher_accepts())

    def is_terminated(self) -> bool:
        return self.ended or bool(self.error) or self.matcher.is_terminated()

    def _closing(self) -> bool:
        return self.max_tokens is not None and self.max_tokens - self.consumed <= self.closing_window

    # -- masks -----------------------------------------------------------------------------

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write this sequence's allowed ids into bitmask[row] ([B, W] int32, CPU, contiguous)."""
        words = bitmask.shape[1]
        if words < self.tok_words:
            raise ValueError(f"bitmask has {words} words per row, the vocabulary needs {self.tok_words}")
        if not self.is_terminated():
            self.matcher.fill_bitmask(bitmask[row].data_ptr(), words)
        self.finish_row(bitmask, row)

    def finish_row(self, bitmask: torch.Tensor, row: int) -> None:
        """After the backend wrote its words: clear padding, set EOS by acceptance, closing mode."""
        words = bitmask.shape[1]
        out = bitmask[row].numpy().view(np.uint32)  # [W] shares memory with the tensor
        eos_row, closer_tiers, ws_row = _special_rows(self.compiled.tokenizer, self.eos_ids, words)
        if self.is_terminated():
            out[:] = eos_row
            return
        out[self.tok_words:] = 0
        out &= ~eos_row
        if self.guard is not None:
            self.guard.filter(out)
            if not out.any():  # a dead end the guard could not see ahead of: end here (the output is
                # reported invalid and retried) rather than let unchecked SQL through
                self.guard_fallbacks += 1
                self.error = self.error or "SQL scope guard: no token can bind the names written so far"
                out[:] = eos_row
                return
        if self._ws_run >= self.max_whitespace_run:
            no_ws = out & ~ws_row
            if no_ws.any():
                out[:] = no_ws
        accepting = self._matcher_accepts()
        if not accepting and (forced := self._planned_token()) is not None:
            out[:] = ids_to_row((forced,), words)
            return
        if self._closing():
            if accepting:
                out[:] = eos_row
                return
            if isinstance(self.guard, SQLScopeGuard):
                closer_tiers = _sql_closer_rows(self.compiled.tokenizer, self.guard.scope.mode, words)
            for tier in closer_tiers:
                closing = out & tier
                if closing.any():
                    out[:] = closing
                    break
        if accepting:
            out |= eos_row
        if not out.any():  # dead end (matcher error): end the sequence; validation reports it
            self.error = self.error or self.matcher.error() or "no token can continue the output"
            out[:] = eos_row

    # -- one token without the mask -----------------------------------------------------------

    def first_allowed(self, candidates: Sequence[int]) -> int | None:
        """The first of `candidates` (the sampler's ranking) that this step's mask allows, or None where the
        full mask must decide: none of them is allowed, or one is that only the whole row rules on."""
        checked, found = 0, None
        for token in candidates:
            checked += 1
            verdict = self.allows_token(token)
            if verdict is None:
                break
            if verdict:
                found = token
                break
        self.count_lazy(found is not None, checked)
        return found

    def count_lazy(self, found: bool, checked: int = 0) -> None:
        """Count one lazy step: decided without the full mask (`first_allowed`'s candidates, or a `known_row`) or
        not; `checked` candidates asked."""
        self.lazy_checked += checked
        self.lazy_hits += found
        self.lazy_fallbacks += not found
        if (totals := getattr(self.mask_batcher, "lazy_totals", None)) is not None:  # the process's, for /metrics
            totals["hits"] += found
            totals["candidates_checked"] += checked
            totals["fallbacks"] += not found

    def known_row(self) -> tuple[int, ...] | None:
        """Every id `fill_bitmask` would allow now, found without the mask, where its rules reduce the row to a few
        known ids: an ended constraint's EOS; a committed completion plan's next token (the output incomplete); in
        the closing window, EOS where the output is complete, else the plan's token, else the first closing tier
        the grammar allows and the guard keeps any of. None where the full mask must tell (the row may be a guard's
        dead end, or no tier is left). The planner runs in the same state as `finish_row` would run it."""
        if self.is_terminated():
            return self.eos_ids
        closing = self._closing()
        if not (closing or self.plan):
            return None
        accepting = self._matcher_accepts()
        if accepting and not closing:
            return None  # (the row is the rest of the grammar's ids plus EOS)
        tiers = self._tier_ids() if closing and not accepting else None
        if tiers is None and closing and not accepting:
            return None  # (the grammar cannot rule on a tier's id alone here)
        witness = any(tiers) if tiers else False  # tiers hold only ids the grammar allows and the guard keeps
        if self.guard is not None and not witness and not self._guard_leaves_some(self.plan[:1] if self.plan else ()):
            return None  # (finish_row's dead-end rule: the row may be empty)
        if accepting:
            return self.eos_ids
        if (forced := self._planned_token()) is not None:
            return (forced,)
        return next((t for t in tiers if t), None) if tiers else None

    def _tier_ids(self) -> list[tuple[int, ...]] | None:
        """Per closing tier (`finish_row`'s, in its order), its ids that the grammar allows and the guard keeps;
        None where the grammar cannot rule on one of them alone (forced bytes that tokenize to no whole token).
        Kept per state: the sampler's known row and each candidate's check ask it in the same state."""
        if self._tiers is None or self._tiers[0] != self.consumed:
            self._tiers = (self.consumed, self._find_tier_ids())
        return self._tiers[1]

    def _find_tier_ids(self) -> list[tuple[int, ...]] | None:
        tok = self.compiled.tokenizer
        spans = (_sql_tiers(self.guard.scope.mode) if isinstance(self.guard, SQLScopeGuard) else CLOSING_TIERS)
        tiers, flat = [], []
        for closing, first in spans:
            allowed = []
            for t in _closer_ids(tok, closing, first):
                if t >= self.vocab_size:
                    continue
                if (verdict := self.matcher.allows(t)) is None:
                    return None
                if verdict:
                    allowed.append(t)
            tiers.append(allowed)
            flat += allowed
        if self.guard is not None and flat:
            kept = dict(zip(flat, self.guard.keeps(np.array(flat, dtype=np.int64)).tolist(), strict=True))
            tiers = [[t for t in ids if kept[t]] for ids in tiers]
        return [tuple(ids) for ids in tiers]

    def allows_token(self, token: int) -> bool | None:
        """Whether `fill_bitmask` would allow `token` now (grammar, guard, EOS, whitespace and completion-plan
        rules), found without the mask; None where the answer depends on the rest of the row (the closing window
        unless it leaves the row as it is, a completion plan, a whitespace token past the run limit, EOS beside a
        guard that may leave nothing)."""
        if self.is_terminated():
            return token in self.eos_ids  # (the row is EOS alone)
        if self.plan or (self._closing() and not self._closing_leaves_row()):
            return None
        if token in self.eos_ids:  # (a guard's dead end allows EOS alone: only a row the guard leaves some token
            # in follows the acceptance rule)
            return self._matcher_accepts() if self.guard is None or self._guard_leaves_some() else None
        if token >= self.vocab_size:
            return False
        if (grammar := self.matcher.allows(token)) is not True:
            return grammar
        if self.guard is not None and not self.guard.keeps(np.array([token], dtype=np.int64))[0]:
            return False  # (the full row's filter, run over this token alone)
        piece = self._token_bytes[token] if token < len(self._token_bytes) else None
        if self._ws_run >= self.max_whitespace_run and piece and not piece.strip():
            return None
        if not self._matcher_accepts() and self._planned_token() is not None:
            return None  # (the plan's token alone is allowed from here: the full mask says which)
        return True

    def _closing_leaves_row(self) -> bool:
        """In the closing window: whether `finish_row` leaves the row as it does outside it (the output incomplete,
        no closing tier with an id the grammar allows and the guard keeps, no completion plan's token), so its ids
        follow the rules outside the window; False where not known."""
        if self._matcher_accepts() or (tiers := self._tier_ids()) is None or any(tiers):
            return False
        return self._planned_token() is None

    def _guard_leaves_some(self, also: Sequence[int] = ()) -> bool:
        """True where a token that nearly every output can go on with (";", " ", a newline), or one of `also`, is
        allowed by the grammar and kept by the guard: the guard leaves this step's row non-empty (False: not
        known)."""
        ids = [t for t in (*also, *_witness_ids(self.compiled.tokenizer))
               if t < self.vocab_size and t not in self.eos_ids and self.matcher.allows(t) is True]
        return bool(ids) and bool(self.guard.keeps(np.array(ids, dtype=np.int64)).any())

    def forced_by_grammar(self) -> int | None:
        """The one id this step's full mask allows, found without it, where the grammar forces bytes that start with
        a whole token and the other rules leave that token (`allows_token`); None where the mask must tell."""
        if self.is_terminated():
            return None
        token = self.matcher.forced_token()  # None where no bytes are forced
        return token if token is not None and self.allows_token(token) is True else None

    def may_force(self) -> bool:
        """False where no token can be forced now unless the grammar forces bytes (not ended, no completion
        plan, outside the closing window): jump-forward skips the mask then."""
        if self.is_terminated() or self._closing() or self.plan:
            return True
        return self.matcher.forces() is not False

    def _planned_token(self) -> int | None:
        """Next token of the completion path when the budget requires following it now (else None)."""
        llg = self.matcher.llg
        if llg is None or self.max_tokens is None:
            return None
        remaining = self.max_tokens - self.consumed  # this step included; EOS needs one of them
        if not self.plan and self.consumed >= self._next_plan_check:
            path = self._completion_path(llg, remaining - 1)
            if path is None:  # nothing found that fits: back off (outside the closing window), and stop searching
                # once failed searches have cost this output PLAN_SEARCH_LIMIT_S
                self.plan_failures += 1
                self._next_plan_check = self.consumed + (4 if self._closing() else max(4, remaining // 2))
                if self.plan_search_s > PLAN_SEARCH_LIMIT_S:
                    self._next_plan_check = self.max_tokens
            elif len(path) + 1 + self.closing_margin >= remaining or self._closing():
                self.plan = path  # inside the closing window the first path found is followed
            else:  # room left: measure again a quarter of the way to where the path must start (each
                # step can lengthen it by a few tokens: an opened object, a required key)
                self._next_plan_check = self.consumed + max(1, (remaining - len(path) - 1 - self.closing_margin) // 4)
        return self.plan[0] if self.plan else None

    def _completion_path(self, llg, max_depth: int) -> list[int] | None:
        """A completion path of at most `max_depth` ids from the current state: the last path found where it still
        completes the output (`_known_path`) and the budget cannot bind before the next check (or, in the closing
        window, at all); else closing.shortest_completion (shared by the states of equal key: closing.shared_path),
        or the known path where it is the shorter."""
        known = self._known_path(llg, max_depth)
        if known is not None and (self._closing() or len(known) + 1 + self.closing_margin <= max_depth):
            self.plan_reuses += 1
            path = known
        else:
            guard = self.guard.path_view() if isinstance(self.guard, SQLScopeGuard) else self.guard

            def search() -> list[int] | None:
                return shortest_completion(llg, self.compiled.tokenizer, max_depth, _hints(self.compiled.spec),
                                           allow=guard.allows if guard is not None else None,
                                           accept=self._accepts_end if self._end_check is not None else None,
                                           first=guard.closing_moves if isinstance(self.guard, SQLScopeGuard)
                                           else None)
            t0 = time.perf_counter()
            path, searched = shared_path((self.compiled, max_depth, digest(self._output)), search)
            self.plan_searches += searched
            self.plan_search_s += time.perf_counter() - t0
            if path is None or (known is not None and len(known) < len(path)):
                path = known
        self._last_path = path
        return list(path) if path is not None else None

    def _known_path(self, llg, max_depth: int) -> tuple[int, ...] | None:
        """The shortest suffix (of the `KNOWN_SUFFIXES` shortest, at most `max_depth` ids) of the last path found
        that takes the output from here to an accepting state the guard keeps: the output wrote, its own way, what
        the path's head closes (a string's rest, a required member) or followed it; None where none does. SQL too:
        a path's text binds names for the scopes of the state it was found in, and the guard rules on the suffix in
        today's scopes (`allows(rest, final)`: every qualifier bound, no alias declared twice in one FROM), as on a
        searched path (the rest of a path the output followed is one of the suffixes)."""
        path = self._last_path
        if path is None:
            return None
        starts = range(len(path) - 1, max(-1, len(path) - 1 - KNOWN_SUFFIXES, len(path) - 1 - max_depth), -1)
        for start in starts:
            rest = list(path[start:])  # 1..max_depth ids (the range's bounds)
            if llg.validate_tokens(rest) != len(rest):
                continue
            copy = llg.deep_copy()
            if (copy.try_consume_tokens(rest) == len(rest) and copy.is_accepting()
                    and (self.guard is None or self.guard.allows(rest, True))
                    and (self._end_check is None or self._accepts_end(rest))):
                return path[start:]
        return None

    def _accepts_end(self, path: Sequence[int]) -> bool:
        """Whether validation accepts the output completed by `path` (the keywords the grammar leaves to it)."""
        tb = self._token_bytes
        return self._end_check(b"".join(tb[t] or b"" for t in (*self._output, *path)))

    def forced_token(self, token_ids: Sequence[int]) -> int | None:
        """The one id the mask allows after `token_ids` (jump-forward: sampling could pick nothing else), or None.
        The mask is kept for the step that samples from it (by the mask batcher, else for `__call__`)."""
        if self.mask_batcher is not None:
            return self.mask_batcher.forced_tokens([(self, token_ids)])[0]
        self.advance(token_ids)
        self._peeked = (self.consumed, torch.empty(1, self.tok_words, dtype=torch.int32))
        self.fill_bitmask(self._peeked[1], 0)
        return only_id(self._peeked[1][0])

    def __call__(self, token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        """Logits-processor form: advance by the new ids, then mask logits [V] in place."""
        self.advance(token_ids)
        words = bitmask_words(logits.shape[-1])
        if self._peeked is not None and self._peeked[0] == self.consumed:  # forced_token computed it
            mask, self._peeked = self._peeked[1], None
            apply_bitmask_(logits.view(1, -1)[:, :mask.shape[1] * 32], mask)
            logits[mask.shape[1] * 32:] = float("-inf")
            return logits
        if self._scratch is None or self._scratch.shape[1] != words:
            self._scratch = torch.empty(1, words, dtype=torch.int32)
        self.fill_bitmask(self._scratch, 0)
        apply_bitmask_(logits.view(1, -1), self._scratch)
        return logits
