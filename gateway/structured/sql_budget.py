"""Budget-aware admission for SQL decoding: a name that adds closing cost is admitted only while the
tokens left cover the text that closes the statement after it.

Before its FROM, a scope may use names that FROM has yet to bind (`t1.max_qty`, a bare column); the
closing texts of sql_closing.py write the FROM items that bind them, and each new name makes them
longer. The scope tracker (sql_scope.py) asks `tier` where a word starts or a qualifier is written:
ANY (the tokens left cover writing any new name and binding it), SCHEMA (a table qualifier or a
column of the schema, whose FROM items are short), or FREE (only names that add nothing: keywords,
functions, names already pending or bound). The cost now is the closing text in tokens of the
request's tokenizer (`measure`); the cost a new name may add is bounded in bytes (a token holds at
least one), so an admitted name can always be written and closed inside the budget.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .sql_scope import SQLScope

FREE, SCHEMA, ANY = 0, 1, 2
# tokens kept back beyond the closing text: the token being decided, EOS, and the grammar's own steps on the
# planner's path (an operand's end, a closing quote or parenthesis)
MARGIN = 8
NAME_MAX = 32  # the grammar's longest new name (NEW_NAME)
_DERIVED = len(", (SELECT 0 AS ) AS d99")  # a FROM item that binds a name no table has, without the name
_QUALIFIED = len(", (SELECT 0 AS ) AS ")  # one that binds a qualifier, without the two names


@dataclass(frozen=True)
class ClosingBudget:
    """A request's admission rule: `measure` gives the tokens of a scope's closing text (None where it
    has none); the reserves are, per tier, the bytes that writing one new name and binding it may take."""

    measure: Callable[[SQLScope], int | None]
    any_reserve: int
    schema_reserve: int
    longest_table: int

    @classmethod
    def for_tables(cls, tables: dict[str, frozenset[str]], measure: Callable[[SQLScope], int | None],
                   tokens: Callable[[str], int]) -> ClosingBudget:
        """The rule for a schema; `tokens` counts a text's tokens (the SCHEMA reserve is measured: its names are
        known; a new name's is bounded by its bytes)."""
        any_reserve = 2 * NAME_MAX + 1 + _QUALIFIED + 2 * NAME_MAX  # `q.c` written, then its FROM item
        cols = {c for cs in tables.values() for c in cs}
        # `t.c` or `c` written (quoted: 2 more), then `, t` or a derived table's item (2 more: where the pieces join)
        write = max((tokens(t) for t in tables), default=0) + 1 + max((tokens(c) for c in cols), default=0) + 2
        bind = max([tokens(f", {t}") for t in tables] + [tokens(f", (SELECT 0 AS {c}) AS d99") for c in cols] + [0])
        return cls(measure, any_reserve, write + bind + 2, max((len(n) for n in tables), default=0) + 2)

    def bound(self, scope: SQLScope) -> int:
        """Bytes at least as many as the closing text's (so at least its tokens), without writing it."""
        total = len(scope.mode)  # (a string's closing quote)
        for f in scope.stack:
            total += len(") SELECT 0")  # (or a window call's `) OVER ()`)
            if f.scope and f.phase == "start":  # a WITH clause's end (sql_closing._WITH_END)
                total += len(" c999 AS (SELECT 0) SELECT 0")
            elif f.fresh:  # (a query in a parenthesis that has nothing yet)
                total += len("SELECT 0")
            if f.func and scope.words is not None:  # the arguments a call still needs: `, 0` each (`0` first)
                total += len(", 0") * (max(0, scope.words.arity[f.func][0] - f.args) + 1)
            if f.scope:
                total += len(" FROM ") + sum(len(q) + self.longest_table + _QUALIFIED + sum(len(c) + 9 for c in cols)
                                             for q, cols in f.pending.items())
                total += sum(len(n) + max(self.longest_table + 2, _DERIVED) for n in f.bare)
        return total

    def tier(self, scope: SQLScope) -> int:
        """What a new name may be in `scope` with `scope.left` tokens left: ANY, SCHEMA or FREE."""
        if scope.left is None:
            return ANY
        spare = scope.left - MARGIN
        bound = self.bound(scope)
        if spare - bound >= self.any_reserve:  # (far from the end: nothing measured)
            return ANY
        cost = self.measure(scope)
        cost = bound if cost is None else cost
        return ANY if spare - cost >= self.any_reserve else SCHEMA if spare - cost >= self.schema_reserve else FREE
