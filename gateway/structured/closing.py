"""Budget closing: the shortest token path from a matcher's state to a complete (accepting) output.

Used by Constraint when the token budget runs low: a depth-first search (`shortest_completion`) over
copies of the llguidance matcher, one move per token or forced run, trying closers first and expanding
each state by its allowed one-byte tokens (all allowed tokens where the grammar forces a longer one).
A child that allows the same token set with the same forced bytes as its parent made no visible
progress and is tried last; a search stops at its node budget, one mask computation per node. Every
path it returns was consumed by a real matcher copy, so following it can never break the grammar;
moves are one-byte tokens where the grammar leaves a choice, so budget checks that use its length
are conservative.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import threading
from collections.abc import Callable, Sequence

import numpy as np

from .bitmask import row_allows, row_ids
from .vocab import TokenizerInfo

# Bytes tried first at each level (they end strings, objects, arrays, SQL groups and values).
_CLOSERS = b'"}])\';,'
# Where a state allows many one-byte tokens (free text), try these (plus closers, punctuation and the
# first bytes of the hints) instead of all of them: the same state is usually reached either way.
_REPRESENTATIVE = b"a0A-_:/.@ "
# At most this many candidate tokens per state.
MAX_CANDIDATES = 48
# Longest hint tried as one move (a counted repeat such as `[a-z0-9]{162}` needs all of it).
MAX_HINT = 512
# Strings that satisfy a JSON Schema `format` (shortest sensible instances).
_FORMAT_HINTS = {
    "date-time": "2000-01-01T00:00:00Z", "date": "2000-01-01", "time": "00:00:00Z", "email": "a@a.aa",
    "uri": "a:a", "uri-reference": "a", "uuid": "00000000-0000-0000-0000-000000000000",
    "ipv4": "0.0.0.0", "ipv6": "::1", "hostname": "a", "duration": "P1D",
}
_PATTERN_KEY = re.compile(r'"pattern"\s*:\s*("(?:[^"\\]|\\.)*")')
_FORMAT_KEY = re.compile(r'"format"\s*:\s*"([a-z-]+)"')
_REQUIRED_KEY = re.compile(r'"required"\s*:\s*(\[[^\]]*\])')


def _shortest(items) -> str | None:
    """A shortest string matching a parsed `re` pattern (None where this simple walk cannot tell)."""
    out = []
    for op, av in items:
        name = str(op)
        if name == "LITERAL":
            out.append(chr(av))
        elif name in ("NOT_LITERAL", "ANY"):
            out.append("a" if name == "ANY" or av != ord("a") else "b")
        elif name == "IN":
            ch = _class_member(av)
            if ch is None:
                return None
            out.append(ch)
        elif name == "BRANCH":
            alts = [a for a in (_shortest(b) for b in av[1]) if a is not None]
            if not alts:
                return None
            out.append(min(alts, key=len))
        elif name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"):
            sub = _shortest(av[2])
            if sub is None:
                return None
            out.append(sub * av[0])
        elif name == "SUBPATTERN":
            sub = _shortest(av[3])
            if sub is None:
                return None
            out.append(sub)
        elif name in ("AT", "ASSERT", "ASSERT_NOT"):
            continue
        else:
            return None
    return "".join(out)


def _class_member(items) -> str | None:
    negate = any(str(op) == "NEGATE" for op, _ in items)
    for ch in ("a", "0", "A", "-", "_", ".", " ", "z", "9", "Z", "!", "~"):
        hit = False
        for op, av in items:
            name = str(op)
            if name == "LITERAL":
                hit |= ord(ch) == av
            elif name == "RANGE":
                hit |= av[0] <= ord(ch) <= av[1]
            elif name == "CATEGORY":
                cat = str(av)
                hit |= (("DIGIT" in cat and ch.isdigit()) or ("WORD" in cat and (ch.isalnum() or ch == "_"))
                        or ("SPACE" in cat and ch.isspace())) != ("NOT" in cat)
        if hit != negate:
            return ch
    if not negate:
        for op, av in items:
            if str(op) == "LITERAL":
                return chr(av)
            if str(op) == "RANGE":
                return chr(av[0])
    return None


def completion_hints(source: str) -> tuple[bytes, ...]:
    """Strings that satisfy the `pattern`s and `format`s found in a constraint's source (JSON Schema,
    or a grammar embedding schemas), and its required property names, as JSON-escaped bytes: the
    search tries them as one move, so a string that must contain e.g. `\\d{4}-\\d{2}` can close even
    though no single byte reveals progress, and an object gets its required keys first."""
    import re._parser as sre_parse

    hints: list[str] = []
    for m in _PATTERN_KEY.finditer(source):
        try:
            hints += _alternatives(sre_parse.parse(json.loads(m.group(1))))
        except Exception:  # noqa: BLE001 - a pattern Python cannot parse gives no hint
            continue
    hints += [_FORMAT_HINTS[f] for f in _FORMAT_KEY.findall(source) if f in _FORMAT_HINTS]
    for m in _REQUIRED_KEY.finditer(source):  # required property names: the search writes these keys
        try:  # first, instead of wandering through dozens of optional ones
            hints += [k for k in json.loads(m.group(1)) if isinstance(k, str) and k]
        except ValueError:
            continue
    return tuple(dict.fromkeys(json.dumps(h)[1:-1].encode() for h in hints if len(h) <= MAX_HINT))


def _alternatives(items) -> list[str]:
    """A shortest string per top-level alternative of a parsed pattern (`^all|tags$` -> both): JSON
    Schema patterns search, so after the text already written only one of them may still fit."""
    items = [it for it in items if str(it[0]) != "AT"]
    if len(items) == 1 and str(items[0][0]) == "SUBPATTERN":
        return _alternatives(items[0][1][3])
    if len(items) == 1 and str(items[0][0]) == "BRANCH":
        found = [_shortest(b) for b in items[0][1][1]]
    else:
        found = [_shortest(items)]
    return [h for h in found if h]


@functools.lru_cache(maxsize=8)
def _byte_tokens(tokenizer: TokenizerInfo) -> tuple[np.ndarray, np.ndarray, dict[int, int]]:
    """(ids of the one-byte tokens, closers first, whitespace other than ' ' left out; byte length per
    id; byte -> its one-byte token id)."""
    lengths = np.array([len(b) if b else 1 << 20 for b in tokenizer.token_bytes], dtype=np.int64)
    singles = [(i, b) for i, b in enumerate(tokenizer.token_bytes) if b and len(b) == 1 and (b == b" " or b.strip())]
    singles.sort(key=lambda ib: (_CLOSERS.find(ib[1]) if ib[1] in _CLOSERS else len(_CLOSERS), ib[1]))
    by_byte = {b[0]: i for i, b in singles}
    return np.array([i for i, _ in singles], dtype=np.int64), lengths, by_byte


@functools.lru_cache(maxsize=8)
def _special_ids(tokenizer: TokenizerInfo, vocab: int) -> np.ndarray:
    """Ids below `vocab` of the tokens without bytes (special tokens), read-only: a walk over the whole
    vocabulary, once per tokenizer rather than once per completion search."""
    ids = np.array([i for i, b in enumerate(tokenizer.token_bytes[:vocab]) if b is None], dtype=np.int64)
    ids.flags.writeable = False
    return ids


def _allowed(matcher, n_words: int, buf: np.ndarray) -> np.ndarray:
    matcher.unsafe_compute_mask_ptr(buf.ctypes.data, n_words * 4)
    return buf


def shortest_completion(
    matcher, tokenizer: TokenizerInfo, max_depth: int, hints: tuple[bytes, ...] = (),
    allow: Callable[[list[int], bool], bool] | None = None, max_nodes: int | None = None,
    first: Callable[[list[int]], tuple[tuple[int, ...], ...]] | None = None,
    accept: Callable[[list[int]], bool] | None = None,
) -> list[int] | None:
    """Token ids that take llguidance `matcher` (not modified) to an accepting state, or None if no
    path of at most `max_depth` tokens was found within `max_nodes` expansions (default: enough to
    walk a path of `max_depth` with some backtracking, at least 2000).

    Depth-first (an explicit stack: paths may be thousands of tokens deep), children in closing
    order: the grammar's forced tokens as one move where it forces any, closers, the `hints` (byte
    strings tried as one move), then short tokens and representative bytes. A child whose allowed
    set and forced bytes equal its parent's made no visible progress (one more char of a free
    string): it is tried last, so counted repeats (`\\d{4}`, minLength) still complete but free text
    never loops. `allow(path, final)` may veto a path (extra guards; `final`: as a complete output).
    `first(path)`: token sequences tried as one move before all others after `path` (a guard's own
    completion texts).

    `accept(path)`: a check of a complete output that no prefix can anticipate (JSON Schema keywords only
    validation decides: `uniqueItems`, an overlapping `oneOf`, `not`). Depth-first would go on below the first
    output it refuses (`[0,0,0]` -> `[0,0,0,0]`...) before it tried a sibling, so after a refusal the search
    deepens instead: all paths up to the refused one's length, then 2, 4, 8... tokens longer, each depth with
    its own node budget."""
    if matcher.is_accepting() and (allow is None or allow([], True)) and (accept is None or accept([])):
        return []
    vocab = tokenizer.vocab_size
    n_words = (vocab + 31) // 32
    singles, lengths, by_byte = _byte_tokens(tokenizer)
    singles = singles[singles < vocab]
    specials = _special_ids(tokenizer, vocab)
    preferred = set(_CLOSERS) | set(_REPRESENTATIVE) | {h[0] for h in hints}
    macros = [[by_byte[b] for b in h] for h in hints if all(b in by_byte for b in h)]
    buf = np.zeros(n_words, dtype=np.uint32)
    nodes = max_nodes if max_nodes is not None else max(2000, 3 * max_depth)
    budget = nodes
    refused: list[int] = []  # lengths of complete paths `accept` refused

    in_buf = None  # the state whose mask `buf` holds: a child's key, then its moves, use one mask

    def key_of(state) -> bytes:
        nonlocal in_buf
        in_buf = state
        h = hashlib.blake2b(_allowed(state, n_words, buf).tobytes(), digest_size=16)
        h.update(bytes(state.compute_ff_bytes()))
        return h.digest()

    def moves(state, path: list[int]) -> list[list[int]]:
        nonlocal in_buf
        forced = [t for t in state.compute_ff_tokens() if t < vocab]
        mask = buf if in_buf is state else _allowed(state, n_words, buf)
        in_buf = state
        cands = singles[row_allows(mask, singles)]  # closers first
        if cands.size > MAX_CANDIDATES:  # free text: closers, representatives, hint starts (or, inside
            # a multi-byte UTF-8 character, where only continuation bytes fit: the first of them)
            picked = [t for t in cands.tolist() if tokenizer.token_bytes[t][0] in preferred]
            cands = np.array(picked) if picked else cands[:MAX_CANDIDATES]
        elif not cands.size:  # the grammar forces a multi-byte token here: the shortest ones
            allowed = row_ids(mask, vocab)
            cands = allowed[np.argsort(lengths[allowed], kind="stable")][:MAX_CANDIDATES]
        out = [[t] for t in cands.tolist() if t not in tokenizer.eos_ids]
        n_close = sum(1 for m in out if (tokenizer.token_bytes[m[0]] or b"")[:1] in (b'"', b"}", b"]", b")", b"'"))
        # special tokens that end free text here (a tool format's </arg_value>, <|end|>): closers too
        ends = [[t] for t in specials[row_allows(mask, specials)].tolist() if t not in tokenizer.eos_ids] \
            if specials.size else []
        own = [list(m) for m in first(path)] if first is not None else []
        return own + ([forced] if forced else []) + ends + out[:n_close] + macros + out[n_close:]

    def expand(state, path: list[int], key: bytes, depth: int):
        """Yields children to descend into, in order, or one complete path (a list) when found."""
        nonlocal budget
        stalled = []
        for move in moves(state, path):
            if budget <= 0 or len(path) + len(move) > depth:
                continue
            budget -= 1
            child = state.deep_copy()
            if child.try_consume_tokens(move) != len(move):
                continue
            child_path = path + move
            if allow is not None and not allow(child_path, False):
                continue
            if child.is_accepting() and (allow is None or allow(child_path, True)):
                if accept is None or accept(child_path):
                    yield child_path
                    return
                refused.append(len(child_path))
            child_key = key_of(child)
            if child_key == key:
                if not stalled:
                    stalled.append((child, child_path))
                continue
            yield child, child_path, child_key, depth
        for child, child_path in stalled:
            yield child, child_path, key, depth

    def search(depth: int, deepening: bool) -> list[int] | None:
        root = matcher.deep_copy()
        stack = [expand(root, [], key_of(root), depth)]
        while stack:
            if refused and not deepening:
                return None
            item = next(stack[-1], None)
            if item is None:
                stack.pop()
            elif isinstance(item, list):
                return item
            else:
                stack.append(expand(*item))
        return None

    path = search(max_depth, False)
    if path is not None or not refused:
        return path
    depth, step = min(refused), 2
    while depth <= max_depth:
        budget = nodes
        if (path := search(depth, True)) is not None:
            return path
        if depth == max_depth:
            break
        depth, step = min(depth + step, max_depth), step * 2
    return None


# (compiled constraint, max depth, digest of the ids consumed) -> the completion path from that state
# (ClosingPlanner.completion_path), least recently used dropped past the bound; masks are filled on the engine thread
# and the mask-prefetch thread
_PATHS: dict[tuple[object, int, bytes], tuple[int, ...] | None] = {}
_PATHS_MAX = 256
# The closing planner tries at most this many suffixes of the last path found before it searches (ClosingPlanner.known_path)
KNOWN_SUFFIXES = 256
_PATHS_LOCK = threading.Lock()


def digest(ids: Sequence[int]) -> bytes:
    return hashlib.blake2b(np.asarray(ids, dtype=np.int64).tobytes(), digest_size=16).digest()


START = digest(())  # the key part of a start state (nothing consumed)


def drop_shared_paths() -> None:
    """Forget the shared completion paths of every state but the start states: a benchmark that decodes the same
    outputs again (repeats, full and lazy masking) would otherwise find all of them shared."""
    with _PATHS_LOCK:
        for key in [k for k in _PATHS if k[2] != START]:
            del _PATHS[key]


def shared_path(key: tuple[object, int, bytes], search: Callable[[], list[int] | None]
                ) -> tuple[tuple[int, ...] | None, bool]:
    """(the completion path of `key`'s state, whether `search` ran for it). The path depends only on the compiled
    constraint, the ids consumed (matcher and guard are functions of them) and the depth: searched once per key
    and shared by the requests that reach that state (every request's start state; rows of one schema that wrote
    the same output)."""
    with _PATHS_LOCK:
        hit = key in _PATHS
        if hit:
            _PATHS[key] = path = _PATHS.pop(key)  # (now the most recently used)
    if hit:
        return path, False
    found = search()
    path = tuple(found) if found is not None else None
    with _PATHS_LOCK:
        if len(_PATHS) >= _PATHS_MAX:
            del _PATHS[next(iter(_PATHS))]  # the least recently used
        _PATHS[key] = path
    return path, True
