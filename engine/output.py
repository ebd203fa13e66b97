"""What leaves the engine for a sequence: its text (detokenized, cut at stop strings, held back while it
could still grow into one) around its structured segments, and the segment events, as RequestOutputs.

The one place text is made: the gateway maps these outputs to OpenAI objects and never decodes tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.segments import SegmentEnd, SegmentStart, Switch
from engine.sequence import Sequence


@dataclass(slots=True)  # built per sequence and step: no __dict__ to make
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]  # since the previous output of this request
    new_text: str  # precedes this output's segment events
    finished: bool
    finish_reason: str | None  # stop | length | abort | error
    error: str | None = None  # why the request failed (finish_reason "error")
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    cache_hits: dict[str, int] | None = None  # blocks served per tier (device, ram, disk, redis)
    segment_events: list[SegmentStart | SegmentEnd] = field(default_factory=list)  # since the previous output
    open_segment: str | None = None  # the kind of a segment still open when the sequence finished
    segment_error: str | None = None  # a segment's constraint failed (the sequence then only ended)
    # `token_ids` and `text` are read from these: the sequence's own output list (it only grows) and its text
    # (a str, never changed in place) up to where this output stood, so a step copies neither.
    output_ids: list[int] = field(default_factory=list, repr=False)
    num_output_ids: int = 0
    all_text: str = field(default="", repr=False)
    num_chars: int = 0

    @property
    def token_ids(self) -> list[int]:
        """All output tokens so far."""
        return self.output_ids[: self.num_output_ids]

    @property
    def text(self) -> str:
        """All output text released so far (outside segments)."""
        return self.all_text[: self.num_chars]


def stop_holdback(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that could still grow into a stop string."""
    hold = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), hold, -1):
            if stop.startswith(text[-n:]):
                hold = n
                break
    return hold


def _cut_at_stop(seq: Sequence) -> bool:
    """Cuts `seq.text` at the first stop string not yet released; True when one was found."""
    for stop in seq.params.stop:
        at = seq.text.find(stop, max(0, seq.emitted - len(stop)))
        if at >= 0:
            seq.text = seq.text[:at]
            return True
    return False


def push_token(seq: Sequence, token: int, is_end: bool) -> tuple[bool, Switch | None]:
    """The sequence sampled `token` (`is_end`: an EOS or stop token id): its text and segments advance.
    Returns (a stop string ended the text, the segment switch the token caused)."""
    tracker = seq.segments
    if tracker is None:  # free text only: what the general path below does without segments
        if seq.detokenizer is None or is_end:
            return False, None
        seq.text += seq.detokenizer.push(token)
        return bool(seq.params.stop) and _cut_at_stop(seq), None
    index = len(seq.output_token_ids) - 1
    was_open = tracker.open
    switch = tracker.push(token) if not is_end else None
    opened = tracker.open if switch is not None and was_open is None else None
    in_segment = was_open is not None or (opened is not None and opened.start <= index)
    if seq.detokenizer is None or is_end:
        return False, switch
    if not in_segment:
        seq.text += seq.detokenizer.push(token)
    if opened is not None:  # the free text before a segment is complete: no part of it is held back
        seq.text += seq.detokenizer.flush()
    if _cut_at_stop(seq):
        if opened is not None:  # the answer ended before the segment: it never opened
            tracker.detector.segments.pop()
            tracker.constraint = None
        return True, None
    return False, switch


def record_switch(seq: Sequence, switch: Switch, applied: bool, tokenizer) -> None:
    """A SegmentStart (a segment opened) or SegmentEnd (it closed: its tokens and text) for the next output."""
    tracker = seq.segments
    if tracker.open is not None:
        tracker.events.append(SegmentStart(switch, applied))
        return
    seg = tracker.detector.segments[-1]
    ids = seq.output_token_ids[seg.start:seg.end]
    tracker.events.append(SegmentEnd(switch, applied, ids, tokenizer.decode(ids) if tokenizer is not None else ""))


def finish_text(seq: Sequence) -> None:
    """The sequence ends: text still inside the detokenizer (an unfinished character) is released."""
    if seq.detokenizer is not None and (seq.segments is None or seq.segments.open is None):
        seq.text += seq.detokenizer.flush()


def make_output(seq: Sequence) -> RequestOutput:
    """The sequence's output since the previous one: text past what was released (minus what could still grow
    into a stop string), new tokens, segment events."""
    finished, tracker, text, stops = seq.is_finished, seq.segments, seq.text, seq.params.stop
    whole = finished or not stops or (tracker is not None and tracker.open is not None)  # free text cannot grow now
    release = len(text) if whole else len(text) - stop_holdback(text, stops)
    new_text = text[seq.emitted:release] if release > seq.emitted else ""
    if release > seq.emitted:
        seq.emitted = release
    prev, seq.num_reported = seq.num_reported, len(seq.output_token_ids)
    events = []
    if tracker is not None:
        events, tracker.events = tracker.events, []
    return RequestOutput(  # positional, in field order (a keyword call matches each name: slower per step)
        seq.request_id, seq.prompt_token_ids, seq.output_token_ids[prev:], new_text, finished, seq.finish_reason,
        seq.error, seq.num_cached_tokens,
        seq.cache_hits,  # replaced at each admission, never changed in place: no copy
        events, tracker.open.kind if finished and tracker is not None and tracker.open is not None else None,
        tracker.error if tracker is not None else None, seq.output_token_ids, seq.num_reported, text, seq.emitted,
    )
