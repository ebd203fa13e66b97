"""The two modes every request and every segment runs in (docs: DESIGN.md, "exploration | execution").

A `StrEnum`: members compare equal to their strings, so JSON, metrics labels and policy files keep the
plain words. Imported by the engine, the policies and the gateway; it imports nothing of the project.
"""

from __future__ import annotations

from enum import StrEnum


class Mode(StrEnum):
    EXPLORATION = "exploration"  # free text: the fast precision profile, deferral, best-effort numerics
    EXECUTION = "execution"  # structured output: the exact profile, no deferral, batch-invariant

    @classmethod
    def parse(cls, value: str, what: str = "mode") -> Mode:
        """`value` as a Mode; a ValueError that names both choices otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{what} must be exploration or execution, got {value!r}") from None


EXPLORATION, EXECUTION = Mode.EXPLORATION, Mode.EXECUTION
