"""Per-token SQL scope guard: filters each constrained-decoding mask row with the scope tracker of
sql_scope.py, simulating only the tokens that can veto (grouped by their text up to the last
non-identifier byte, sharing their common prefixes) and testing identifier-only tokens by prefix
masks over the token tables of sql_tokens.py.
"""

from __future__ import annotations

import contextlib
import json

import numpy as np

from .sql_budget import ANY, ClosingBudget
from .sql_closing import closing_text, closing_texts
from .sql_scope import _BANNED, _ID, SCHEMA_COMMENT, WORDS_COMMENT, SQLScope, SQLWords, WordPool, _Veto
from .sql_tokens import (
    NONE,
    RELEVANT,
    TokenTable,
    extending,
    tail_checks,
    tail_classes,
    tail_mask,
    token_table,
    word_mask,
)
from .vocab import TokenizerInfo


def _trie_members(node: dict) -> np.ndarray:
    """The members of every head at or below a trie node of SQLScopeGuard._simulate."""
    found, stack = [], [node]
    while stack:
        n = stack.pop()
        found += [v for k, v in n.items() if not k]
        stack += [v for k, v in n.items() if k]
    return np.concatenate(found) if found else NONE


class SQLScopeGuard:
    """Per-sequence guard: `consume` each generated token, `filter` each mask row, `allows_end`. With
    `max_tokens`, new names are admitted only while the tokens left cover closing the output after them
    (sql_budget.py)."""

    def __init__(self, tables: dict[str, frozenset[str]], tokenizer: TokenizerInfo, fenced: bool,
                 words: SQLWords | None = None, max_tokens: int | None = None) -> None:
        self.scope = SQLScope(tables, fenced, words)
        self.table = token_table(tokenizer)
        self.tokenizer = tokenizer
        self._costs: dict[str, int] = {}  # closing text -> its tokens
        if max_tokens is not None:
            self.scope.left = max_tokens
            self.scope.budget = ClosingBudget.for_tables(tables, self._closing_cost, lambda t: len(tokenizer.encode(t)))

    def _closing_cost(self, scope: SQLScope) -> int | None:
        """Tokens of the text that closes `scope` (sql_closing.closing_text), None where it has none."""
        if (text := closing_text(scope)) is None:
            return None
        if (n := self._costs.get(text)) is None:
            if len(self._costs) > 4096:
                self._costs.clear()
            n = self._costs[text] = len(self.tokenizer.encode(text))
        return n

    @classmethod
    def from_grammar(cls, grammar: str, tokenizer: TokenizerInfo, max_tokens: int | None = None) -> SQLScopeGuard | None:
        """The guard of an SQL grammar from sql_grammar.py (None for grammars without its tables line)."""
        at = grammar.find(SCHEMA_COMMENT)
        if at < 0:
            return None
        line = grammar[at + len(SCHEMA_COMMENT):].split("\n", 1)[0]
        tables = {t.lower(): frozenset(c.lower() for c in cols) for t, cols in json.loads(line).items()}
        at = grammar.find(WORDS_COMMENT)
        words = (SQLWords.from_json(json.loads(grammar[at + len(WORDS_COMMENT):].split("\n", 1)[0]))
                 if at >= 0 else None)
        return cls(tables, tokenizer, fenced='"\\n```"' in grammar, words=words, max_tokens=max_tokens)

    def _text(self, token: int) -> str:
        return self.table.texts[token] if token < len(self.table.texts) else ""

    def consume(self, token: int) -> None:
        with contextlib.suppress(_Veto):  # only reachable if a vetoed token was forced in; validation reports it
            self.scope.feed(self._text(token))
        if self.scope.left is not None:
            self.scope.left -= 1

    def allows(self, tokens: list[int], final: bool) -> bool:
        """Whether `tokens` (after the text so far) keep every qualifier bindable (and, `final`, bound)."""
        return self.path_view().allows(tokens, final)

    def closing_moves(self, tokens: list[int] = ()) -> tuple[tuple[int, ...], ...]:
        """Token sequences that, after `tokens` (following the text so far), bind the names the
        innermost scope left unbound (sql_closing.closing_texts), for the completion search to try first."""
        return self.path_view().closing_moves(tokens)

    def path_view(self) -> _PathStates:
        """`allows` and `closing_moves` for the completion search: the scope after each path it tries kept, so a
        child's costs its own move, not its whole path again (a search walks paths hundreds of tokens deep)."""
        return _PathStates(self)

    def allows_end(self) -> bool:
        return self.allows([], final=True)

    def filter(self, out: np.ndarray) -> None:
        """Clear, in mask row `out` (uint32 words), the tokens that would leave a qualifier unbound
        (or start a word that could only go on as one)."""
        self._filter(out, self.table)

    def keeps(self, tokens: np.ndarray) -> np.ndarray:
        """Whether `filter` keeps each of `tokens` (int64 ids) in a row that allows it: the same rules run over a
        table of these tokens alone (TokenTable.subset), so a few candidates cost no vocabulary-wide pass."""
        row = np.full((len(tokens) + 31) // 32, 0xFFFFFFFF, dtype=np.uint32)
        self._filter(row, self.table.subset(tokens))
        return np.unpackbits(row.view(np.uint8), bitorder="little")[: len(tokens)].astype(bool)

    def keeps_one(self, token: int) -> bool:
        """`keeps` of one id (the lazy checks' question for each candidate)."""
        return bool(self.keeps(np.array([token], dtype=np.int64))[0])

    def _filter(self, out: np.ndarray, tt: TokenTable) -> None:
        """`filter` over the tokens of table `tt` (bit j of `out`: tt's token j).

        Only tokens that can veto are simulated. While a column name is written: identifier-only
        tokens by a prefix test, the others one by one. Otherwise, with nothing pending: tokens with
        a "."; with qualifiers pending: tokens whose text holds . ) ; or a quote, or completes a word
        that ends a clause or names a pending qualifier (or the word being written, in a FROM
        clause); grouped by their text up to the last non-identifier byte. Where words are checked
        (SQLScope.word_pool), a prefix test rules on the word being written (identifier-only tokens
        and the leading identifier of the others), and after a simulated head the identifier that
        follows it is tested the same way."""
        s = self.scope
        bits = np.unpackbits(out.view(np.uint8), bitorder="little")[: len(tt.texts)].astype(bool)
        drop = np.zeros(len(out) * 32, dtype=bool)  # the vetoed tokens
        keep = bits & tt.delim
        if s.dot_q is not None and (columns := s.columns_for(s.dot_q, quoted=bool(s.mode))) is None:
            # any name (FROM may declare q as a derived table that has it): identifier-only tokens go on
            # with it, the others end it with their leading identifier
            named = np.flatnonzero(keep & ~tt.lead_empty)
            keep &= tt.lead_empty
            drop[self._any_name_heads(named, tt)] = True
        elif s.dot_q is not None:  # identifier-only tokens extend the column name: a prefix test
            drop[: len(bits)] |= bits & ~tt.delim & ~extending(tt, frozenset(columns), s.word)
            if not s.mode:  # (inside quotes every other token is simulated)
                ends = np.zeros(len(tt.texts), dtype=bool)  # tokens whose leading identifier ends a column
                for c in columns:
                    if c.startswith(s.word) and (ids := tt.leads.get(c[len(s.word):])) is not None:
                        ends[ids] = True
                if not s.word:  # a quoted column name may start
                    ends |= tt.quote_start
                drop[: len(keep)] |= keep & ~ends
                keep &= ends
        elif s.mode and s.mode != s.string:  # inside a quoted name: the few tokens the grammar allows there
            if s.pool is None:  # unchecked until its closing quote (SQLite's "...": a name or a string)
                keep &= tt.quotes
            else:
                drop[: len(bits)] |= bits & ~tt.delim & ~extending(tt, s.pool.words, s.word)
        else:
            if (pool := s.pool if s.word else s.word_pool()) is not None:
                ok = word_mask(tt, pool, s.word)
                drop[: len(bits)] |= bits & ~ok
                keep &= ok
            pending = {q for f in s.stack if f.scope for q in f.pending}
            # names used before a FROM (or the word being written, if it becomes one) may be unbound
            unsettled = any(f.scope and (f.pending or f.bare or f.phase in ("start", "select")) for f in s.stack)
            if not unsettled:
                sim = tt.dots | tt.quotes
            else:
                sim = tt.hot | tt.quotes
                for w in pending:
                    if (ids := tt.inners.get(w)) is not None:
                        sim[ids] = True
                in_from = any(f.scope and f.phase == "from" for f in s.stack)
                for w in RELEVANT | pending | ({s.word} if in_from else set()):
                    if w.startswith(s.word) and (ids := tt.leads.get(w[len(s.word):])) is not None:
                        sim[ids] = True
            checks = keep & tail_checks(tt, s.words.before_operand) if s.words is not None and not s.mode else None
            if s.in_by_list():  # a number there is an output column's position (SQLScope.ordinal_ok)
                sim |= tt.has_digit
                if checks is not None:
                    checks &= ~tt.has_digit
                if not s.word or s.word[:1].isdigit():
                    numbers = np.flatnonzero(bits & ~tt.delim & tt.digit_start)
                    drop[[t for t in numbers.tolist() if not s.ordinal_ok(s.word + tt.texts[t])]] = True
            if checks is not None:  # the identifier after the head may start a checked word
                drop[self._safe_tails(np.flatnonzero(checks), sim, tt)] = True
            if any(f.func for f in s.stack):  # argument counts: "," and ")" may veto
                sim |= tt.arg_marks
            elif s.words is not None and (s.word or s.at) in s.words.arity:  # a call opened and closed by one token
                sim |= tt.call_marks
            if not s.mode and unsettled:
                # a word that may not become a clause keyword yet (SQLScope._bans)
                if bans := (s.banned if s.word else s._bans()):
                    probe = s if s.word else s.clone()
                    probe.banned = bans
                    for k in bans:  # (the table's lookup first: a few candidates' table seldom has the piece)
                        for end in range(len(s.word) + 1, len(k) + 1):
                            if k.startswith(s.word) and (ids := tt.idents.get(k[len(s.word):end])) is not None \
                                    and probe.only_banned(k[:end]):
                                drop[ids] = True
                for k in _BANNED:  # tokens whose identifier tail may start one: simulated below
                    for end in range(1, len(k) + 1):
                        if (ids := tt.tails.get(k[:end])) is not None:
                            sim[ids] = True
            keep &= sim
        cands = np.flatnonzero(keep)
        fast = (tt.qual[cands] >= 0) & ~tt.tailed[cands]  # `q.` with nothing after the dot
        drop[self._qualifier_heads(cands, fast, tt)] = True
        cands = cands[~fast]
        string = s.mode == "'" and s.string == "'"
        canon = tt.canon[1] if string else tt.canon[0] if not s.mode else tt.head
        heads = canon[cands]
        order = np.argsort(heads, kind="stable")
        cands, heads = cands[order], heads[order]
        starts = np.flatnonzero(np.concatenate(([True], heads[1:] != heads[:-1])))
        groups = zip(heads[starts].tolist(), np.split(cands, starts[1:]), strict=True) if cands.size else ()
        texts = tt.heads if s.mode and not string else tt.canons
        self._simulate([(texts[h], members) for h, members in groups], drop, tt)
        out &= ~np.packbits(drop, bitorder="little").view(np.uint32)

    def _any_name_heads(self, ids: np.ndarray, tt: TokenTable) -> list[int]:
        """Vetoes among tokens (ids) that end a name any of which may follow `q.` with their leading
        identifier: simulated by what follows it (one stand-in name per group where that is punctuation
        only; one by one where it holds another word)."""
        drop = np.zeros(len(tt.texts), dtype=bool)
        if not ids.size:
            return []
        rests = tt.rest[ids]
        order = np.argsort(rests, kind="stable")
        ids, rests = ids[order], rests[order]
        starts = np.flatnonzero(np.concatenate(([True], rests[1:] != rests[:-1])))
        heads: list[tuple[str, np.ndarray]] = []
        for r, members in zip(rests[starts].tolist(), np.split(ids, starts[1:]), strict=True):
            rest = tt.rests[r]
            if any(ch in _ID for ch in rest):
                heads += [(tt.texts[t][: len(tt.heads[tt.head[t]])], np.array([t])) for t in members.tolist()]
            else:
                heads.append(("x" + rest, members))
        self._simulate(heads, drop, tt)
        return np.flatnonzero(drop).tolist()

    def _simulate(self, heads: list[tuple[str, np.ndarray]], drop: np.ndarray, tt: TokenTable) -> None:
        """Feed each head (the text the tokens `members` share up to their last non-identifier byte)
        and set in `drop` the tokens it vetoes, or whose identifier after it cannot start a word there.
        The heads share their common prefixes: a trie of them walked depth first, each character fed
        once per trie node and the state cloned only where the trie branches."""
        if not heads:
            return
        trie: dict = {}
        for head, members in heads:
            node = trie
            for ch in head:
                node = node.setdefault(ch, {})
            node[""] = np.concatenate((node[""], members)) if "" in node else members
        self._walk(trie, self.scope.clone(), drop, tt)

    def _walk(self, node: dict, state: SQLScope, drop: np.ndarray, tt: TokenTable) -> None:
        """`state` has read the text to `node`: rule on the heads that end there, then go on into each
        branch (the last one with `state` itself)."""
        if (members := node.get("")) is not None:
            # (SQLScope.feed's end-of-text check: a half-written word on its way to a banned keyword)
            if state.word and state.banned and not state.mode and state.only_banned(state.word):
                drop[members] = True
            else:
                self._after_head(state, members, drop, tt)
        kids = [ch for ch in node if ch]
        for i, ch in enumerate(kids):
            branch = state if i == len(kids) - 1 else state.clone()
            try:
                branch._char(ch)
            except _Veto:
                drop[_trie_members(node[ch])] = True
                continue
            self._walk(node[ch], branch, drop, tt)

    def _after_head(self, state: SQLScope, members: np.ndarray, drop: np.ndarray, tt: TokenTable) -> None:
        """Set in `drop` the tokens `members` (whose head `state` has read) whose identifier after the
        head cannot start a word there (`state` is left as it was)."""
        if state.in_by_list() and (numbers := members[tt.digit_tail[members]]).size:
            drop[[t for t in numbers.tolist() if not state.ordinal_ok(tt.texts[t][len(tt.heads[tt.head[t]]):])]] = True
        if state.mode and state.mode != state.string:  # the tail starts a quoted name
            if state.pool is not None and (tailed := members[tt.tailed[members]]).size:
                drop[[t for t in tailed.tolist() if not state.pool.admits(tt.lower[t][len(tt.heads[tt.head[t]]):])]] = True
        elif state.dot_q is not None:  # the identifier tail starts a column name: a prefix of one
            if (tailed := members[tt.tailed[members]]).size and (cols := state.columns_for(state.dot_q)) is not None:
                pool = WordPool(frozenset(cols), frozenset())
                drop[tailed[~(tail_mask(tt, pool) & ~tt.digit_tail)[tailed]]] = True
        elif (tailed := members[tt.tailed[members]]).size and not state.word and not state.mode:
            if (pool := state.word_pool()) is not None:
                drop[tailed[~tail_mask(tt, pool)[tailed]]] = True
            if bans := state._bans():  # (a word after the head may not start as a clause keyword)
                saved, state.banned = state.banned, bans
                pieces = {k[:e] for k in bans for e in range(1, len(k) + 1)
                          if k[:e] in tt.tails and state.only_banned(k[:e])}  # (only pieces the table has)
                state.banned = saved
                banned = np.zeros(len(tt.texts), dtype=bool)
                for p in pieces:
                    if (ids := tt.tails.get(p)) is not None:
                        banned[ids] = True
                drop[tailed[banned[tailed]]] = True

    def _safe_tails(self, checks: np.ndarray, sim: np.ndarray, tt: TokenTable) -> np.ndarray:
        """Vetoes among tokens (ids `checks`) with an identifier after their head, without simulating
        the heads that change nothing but where a word starts (_SAFE_HEAD), by the byte before that
        identifier (classes with one pool each); sets the other tokens in `sim`."""
        s = self.scope
        veto = [NONE]
        if not checks.size:
            return NONE
        base = s
        if s.word:  # the token's first byte ends the word being written (as whitespace would)
            base = s.clone()
            try:
                base.feed(" ")
            except _Veto:  # those tokens are vetoed by the word check already
                base = None
        if base is not None and base.tier() != ANY:
            sim[checks] = True  # a budget's pool (sql_budget.py) depends on the scopes the head opens: simulated
            return NONE
        if base is not None:
            f = base._scope()
            comma = not (f.phase == "from" and base.stack[-1] is f)  # "," there starts a new source
            is_fast = (tt.safe_comma if comma else tt.safe)[checks]
            fast, checks = checks[is_fast], checks[~is_fast]
            classes = tail_classes(tt, s.words.before_operand, frozenset(s.words.after))
            if base.word_pool(next(iter(classes.keys() - {""}), "")) is not None:  # else no class has one
                for at, members in classes.items():
                    if (pool := base.word_pool(at or base.at)) is not None:
                        m = fast[members[fast]]
                        veto.append(m[~tail_mask(tt, pool)[m]])
        sim[checks] = True
        return np.concatenate(veto)

    def _qualifier_heads(self, cands: np.ndarray, is_qual: np.ndarray, tt: TokenTable) -> list[int]:
        """Vetoes among tokens whose head is `<whitespace><identifier>.` (thousands where any name
        may start a qualifier): unbound names, unless a scope before its FROM can still bind them."""
        s = self.scope
        cands = cands[is_qual]
        if not cands.size:
            return []
        veto: list[int] = []
        spaced = np.array([tt.heads[h][:1].isspace() for h in tt.head[cands].tolist()], dtype=bool)
        for group, after_space in ((cands[spaced], True), (cands[~spaced], False)):
            if not group.size:
                continue
            state = s.clone()
            if after_space:
                try:
                    state.feed(" ")
                except _Veto:
                    veto += group.tolist()
                    continue
            if state.mode:
                continue  # inside a string or a quoted name
            new: frozenset[str] | None = frozenset()
            if state._host() is not None:
                # (the budget's tier where the word starts: here, or where the word being written did)
                if (new := state.new_qualifiers(state.tier() if after_space else state.word_tier)) is None:
                    continue  # any name may be bound later (its columns are checked as they are written)
            prefix = "" if after_space else state.word
            if prefix[:1].isdigit():  # a number's decimal point (not in an output position)
                veto += [] if state.ordinal_ok(prefix + ".") else group.tolist()
                continue
            bound = {q for f in state.stack if f.scope for q in f.declared} | new  # (and those the budget admits)
            ok = np.zeros(len(tt.texts), dtype=bool)
            if not prefix:  # a "." after no word: a number's decimal point (`.5`)
                ok[tt.quals.get("", NONE)] = True
            for b in bound:
                if b.startswith(prefix) and (ids := tt.quals.get(b[len(prefix):])) is not None:
                    ok[ids] = True
            veto += group[~ok[group]].tolist()
        return veto


class _PathStates:
    """The scope after each path of a completion search (None: vetoed), built from its parent path's."""

    def __init__(self, guard: SQLScopeGuard) -> None:
        self.guard = guard
        self.states: dict[tuple[int, ...], SQLScope | None] = {(): guard.scope}
        self.encoded: dict[str, tuple[int, ...]] = {}  # closing texts repeat from node to node

    def state(self, path: list[int] | tuple[int, ...]) -> SQLScope | None:
        key = tuple(path)
        if key in self.states:
            return self.states[key]
        cut = len(key) - 1
        while key[:cut] not in self.states:  # (the search's children extend a path it tried: found at once)
            cut -= 1
        base = self.states[key[:cut]]
        state = None
        if base is not None:
            state = base.clone()
            try:
                for t in key[cut:]:
                    state.feed(self.guard._text(t))
                    if state.left is not None:
                        state.left -= 1
            except _Veto:
                state = None
        self.states[key] = state
        return state

    def allows(self, path: list[int], final: bool = False) -> bool:
        """Whether `path` keeps every qualifier bindable (and, `final`, bound)."""
        state = self.state(path)
        if state is None:
            return False
        if final:
            try:
                state.clone().end()
            except _Veto:
                return False
        return True

    def closing_moves(self, path: list[int] = ()) -> tuple[tuple[int, ...], ...]:
        """The closing texts after `path` (sql_closing.closing_texts), encoded; a word being written is ended
        first (the texts start with a byte that would end it)."""
        state = self.state(path)
        if state is None:
            return ()
        if state.word and not state.mode:
            state = state.clone()
            try:
                state.feed(" ")
            except _Veto:
                return ()
        return tuple(self._encode(t) for t in closing_texts(state))

    def _encode(self, text: str) -> tuple[int, ...]:
        if (ids := self.encoded.get(text)) is None:
            ids = self.encoded[text] = tuple(self.guard.tokenizer.encode(text))
        return ids
