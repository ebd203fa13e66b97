"""Validation outcomes and the bounded strict retry: one loop for whole-output constraints and for segments."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from gateway.structured.errors import SQLPolicyViolation, StructuredOutputError, StructuredValidationError

T = TypeVar("T")
VALIDATION_ERRORS = (StructuredValidationError, SQLPolicyViolation)
RETRY_TEMPERATURE, RETRY_SEED = 0.7, 7919  # a strict retry after a greedy attempt that failed validation


@dataclass(frozen=True)
class Validation:
    """One validation of a structured output or segment (the response's and the audit record's `validations`)."""

    kind: str  # json | tool_calls | sql | text | tool_call | json_fence | sql_fence
    ok: bool
    attempt: int | None = None  # whole-output constraints: which attempt
    error: str | None = None
    output: str | None = field(default=None, repr=False)  # a failed attempt's text: audited, never returned

    def to_dict(self) -> dict:
        d: dict = {"kind": self.kind, "ok": self.ok}
        if self.attempt is not None:
            d["attempt"] = self.attempt
        if self.error is not None:
            d["error"] = self.error
        return d


def failed(kind: str, error: BaseException | str, attempt: int | None = None, output: str | None = None) -> Validation:
    return Validation(kind, False, attempt, str(error)[:300], output)


@dataclass(frozen=True)
class RetryPolicy:
    """Up to `retries` regenerations after an output fails validation. A retry is strict (greedy); when the
    failed attempt already was greedy it samples instead, seeded by the attempt, since a greedy rerun would
    repeat it byte for byte (execution is batch-invariant)."""

    retries: int = 1

    def sampling(self, temperature: float, seed: int | None, index: int, attempt: int) -> tuple[float, int | None]:
        """(temperature, seed) of attempt `attempt` (0: the first, as requested) of choice `index`."""
        if attempt and temperature == 0.0:
            return RETRY_TEMPERATURE, (seed or 0) + index + RETRY_SEED * attempt
        return (0.0 if attempt else temperature), (None if seed is None else seed + index)

    async def run(self, attempt: Callable[[int], Awaitable[T]]) -> T:
        """`attempt(i)` for i = 0, 1, ... until one passes validation. An attempt that fails raises one of
        VALIDATION_ERRORS carrying its outcomes; the last failure is raised with every attempt's outcomes."""
        seen: list[Validation] = []
        last: StructuredOutputError | None = None
        for i in range(1 + self.retries):
            try:
                return await attempt(i)
            except VALIDATION_ERRORS as e:
                seen.extend(e.validations)
                last = e
        last.validations = tuple(seen)
        raise last
