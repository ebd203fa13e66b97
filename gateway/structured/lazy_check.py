"""The lazy check: what a Constraint's full mask row would allow, answered for one token (or a row of a few known
ids) without filling the row, by the same rules (grammar, guard, EOS, whitespace, closing window, completion plan)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .sql_guard import SQLScopeGuard
from .token_sets import CLOSING_TIERS, closer_ids, sql_tiers, witness_ids


class LazyCheck:
    """The sampler's lazy path of `Constraint` (a base class of it): `first_allowed`, `known_row`, `allows_token`,
    `forced_by_grammar`, `may_force` and the counters of `count_lazy`. It reads the Constraint's state (matcher,
    guard, EOS ids, whitespace run, closing window, completion plan) and asks it the rules `finish_row` applies
    (`_matcher_accepts`, `_closing`, `_planned_token`); each answer is the full row's or None where only the row
    can tell."""

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
        spans = (sql_tiers(self.guard.scope.mode) if isinstance(self.guard, SQLScopeGuard) else CLOSING_TIERS)
        tiers, flat = [], []
        for closing, first in spans:
            allowed = []
            for t in closer_ids(tok, closing, first):
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
        if self.guard is not None and not self.guard.keeps_one(token):
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
        ids = [t for t in (*also, *witness_ids(self.compiled.tokenizer))
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

