"""The Constraint's closing planner: when a token budget nears its end, a completion path measured at adaptive
intervals and, once the budget requires it, forced token by token, so output that can close inside the budget
does."""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

from .base import CompiledConstraint, ConstraintKind
from .closing import KNOWN_SUFFIXES, completion_hints, digest, shared_path, shortest_completion
from .errors import StructuredValidationError
from .sql_guard import SQLScopeGuard
from .validate import validate_json

# Seconds of completion searches one output may spend once a search has failed: an output that wrote itself past
# what its budget can close (SQL names that only long FROM items could bind) would otherwise search again every few
# tokens of the closing window, seconds each; past it the closing tiers alone end the output (validation decides)
PLAN_SEARCH_LIMIT_S = 1.0


@functools.lru_cache(maxsize=64)
def _hints(spec) -> tuple[bytes, ...]:
    return completion_hints(spec.source)


def validation_end_check(compiled: CompiledConstraint):
    """For a whole-output JSON Schema whose grammar admits a superset (keywords that validation decides): a
    check of a complete output's bytes against the caller's schema; None where the grammar decides alone."""
    spec, enforcement = compiled.spec, getattr(compiled, "enforcement", None)
    if (spec.kind is not ConstraintKind.JSON_SCHEMA or spec.envelope or enforcement is None
            or not enforcement.needs_validation()):
        return None

    def accepts(text: bytes) -> bool:
        try:
            validate_json(text.decode("utf-8", "replace"), spec.source)
        except StructuredValidationError:
            return False
        return True
    return accepts


class ClosingPlanner:
    """One sequence's completion plan (llguidance matchers). The path is measured at adaptive intervals (a quarter
    of the way to the step where it must start): a suffix of the last path found where one still closes the output
    and leaves room, else closing.shortest_completion (shared by equal states: closing.shared_path); once the budget
    left is no more than the path plus EOS plus `closing_margin` (or at the first path found inside the closing
    window) the path is committed (`plan`) and its tokens are forced one by one.

    The matcher, the guard, the count of ids consumed and whether the closing window is open are the Constraint's,
    passed in per call; the planner keeps the ids the matcher consumed (`output`, the search's state)."""

    def __init__(self, compiled: CompiledConstraint, max_tokens: int | None, closing_margin: int) -> None:
        self.compiled, self.max_tokens, self.closing_margin = compiled, max_tokens, closing_margin
        # JSON Schema keywords that validation decides (oneOf overlap, uniqueItems, `not`...): a path the planner
        # forces must also be an output validation accepts, else the strict retry would close the same way
        self.end_check = validation_end_check(compiled)
        self.plan: list[int] | None = None  # the forced completion path, once committed
        self.next_check = 0  # consumed count at which the completion path is measured again
        self.output: list[int] = []  # the ids the matcher consumed (the completion search's state)
        self.last_path: tuple[int, ...] | None = None  # the completion path last found
        # searches run, checks answered by the last path, seconds in searches
        self.searches = self.reuses = 0
        self.search_s = 0.0
        self.failures = 0  # checks whose search found no path that fits

    def follow(self, token: int) -> None:
        """The committed plan after `token` is consumed: its rest where the token was its head, else none."""
        if self.plan is not None:
            self.plan = self.plan[1:] if self.plan and self.plan[0] == token else None

    def next_token(self, llg, guard, consumed: int, closing: bool) -> int | None:
        """Next token of the completion path when the budget requires following it now (else None)."""
        if llg is None or self.max_tokens is None:
            return None
        remaining = self.max_tokens - consumed  # this step included; EOS needs one of them
        if not self.plan and consumed >= self.next_check:
            path = self.completion_path(llg, guard, remaining - 1, closing)
            if path is None:  # nothing found that fits: back off (outside the closing window), and stop searching
                # once failed searches have cost this output PLAN_SEARCH_LIMIT_S
                self.failures += 1
                self.next_check = consumed + (4 if closing else max(4, remaining // 2))
                if self.search_s > PLAN_SEARCH_LIMIT_S:
                    self.next_check = self.max_tokens
            elif len(path) + 1 + self.closing_margin >= remaining or closing:
                self.plan = path  # inside the closing window the first path found is followed
            else:  # room left: measure again a quarter of the way to where the path must start (each
                # step can lengthen it by a few tokens: an opened object, a required key)
                self.next_check = consumed + max(1, (remaining - len(path) - 1 - self.closing_margin) // 4)
        return self.plan[0] if self.plan else None

    def completion_path(self, llg, guard, max_depth: int, closing: bool) -> list[int] | None:
        """A completion path of at most `max_depth` ids from the current state: the last path found where it still
        completes the output (`known_path`) and the budget cannot bind before the next check (or, in the closing
        window, at all); else closing.shortest_completion (shared by the states of equal key: closing.shared_path),
        or the known path where it is the shorter."""
        known = self.known_path(llg, guard, max_depth)
        if known is not None and (closing or len(known) + 1 + self.closing_margin <= max_depth):
            self.reuses += 1
            path = known
        else:
            view = guard.path_view() if isinstance(guard, SQLScopeGuard) else guard

            def search() -> list[int] | None:
                return shortest_completion(llg, self.compiled.tokenizer, max_depth, _hints(self.compiled.spec),
                                           allow=view.allows if view is not None else None,
                                           accept=self.accepts_end if self.end_check is not None else None,
                                           first=view.closing_moves if isinstance(guard, SQLScopeGuard) else None)
            t0 = time.perf_counter()
            path, searched = shared_path((self.compiled, max_depth, digest(self.output)), search)
            self.searches += searched
            self.search_s += time.perf_counter() - t0
            if path is None or (known is not None and len(known) < len(path)):
                path = known
        self.last_path = path
        return list(path) if path is not None else None

    def known_path(self, llg, guard, max_depth: int) -> tuple[int, ...] | None:
        """The shortest suffix (of the `KNOWN_SUFFIXES` shortest, at most `max_depth` ids) of the last path found
        that takes the output from here to an accepting state the guard keeps: the output wrote, its own way, what
        the path's head closes (a string's rest, a required member) or followed it; None where none does. SQL too:
        a path's text binds names for the scopes of the state it was found in, and the guard rules on the suffix in
        today's scopes (`allows(rest, final)`: every qualifier bound, no alias declared twice in one FROM), as on a
        searched path (the rest of a path the output followed is one of the suffixes)."""
        path = self.last_path
        if path is None:
            return None
        starts = range(len(path) - 1, max(-1, len(path) - 1 - KNOWN_SUFFIXES, len(path) - 1 - max_depth), -1)
        for start in starts:
            rest = list(path[start:])  # 1..max_depth ids (the range's bounds)
            if llg.validate_tokens(rest) != len(rest):
                continue
            copy = llg.deep_copy()
            if (copy.try_consume_tokens(rest) == len(rest) and copy.is_accepting()
                    and (guard is None or guard.allows(rest, True))
                    and (self.end_check is None or self.accepts_end(rest))):
                return path[start:]
        return None

    def accepts_end(self, path: Sequence[int]) -> bool:
        """Whether validation accepts the output completed by `path` (the keywords the grammar leaves to it)."""
        tb = self.compiled.tokenizer.token_bytes
        return self.end_check(b"".join(tb[t] or b"" for t in (*self.output, *path)))
