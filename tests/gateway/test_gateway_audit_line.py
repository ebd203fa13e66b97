"""An appended audit line is the canonical JSON of its record (the hashed body serialised once), whatever the data
holds, keyed or not."""

from __future__ import annotations

import json

import pytest

from gateway.audit import AuditLog
from gateway.audit_record import canonical_json, record_hash
from gateway.audit_verify import verify

DATA = [
    {},
    {"i": 1, "text": "plain"},
    {"content": "naïve 日本語 🙂 \n\t\"quoted\" \\", "prev": "not the chain's", "hash": "x", "v": 9, "zz": None},
    {"lone": "\ud800 half", "pair": "\ud83d\ude00", "nested": {"b": [1, 2.5, -0.0, True], "a": {"event": "e"}}},
    {3: "int keys", 10: "sort as numbers, read back as text", 2: ["after", "normalisation"]},
    {"big": "x" * 5000, "floats": [1e300, 1e-300, 0.1]},
]


@pytest.mark.parametrize("key", [None, b"secret"])
def test_line_is_the_canonical_record(tmp_path, key):
    path = tmp_path / "audit.jsonl"
    with AuditLog(path, fsync="never", key=key) as log:
        recs = [log.append(f"ev.{i}", d, trace_id=None if i % 2 else f"{i:032x}") for i, d in enumerate(DATA)]
    lines = path.read_bytes().splitlines(keepends=True)
    assert len(lines) == len(DATA)
    for rec, line in zip(recs, lines, strict=True):
        assert rec.line == line
        parsed = json.loads(line)
        assert canonical_json(parsed) + b"\n" == line
        assert parsed["hash"] == rec.hash == record_hash(parsed, key)
        assert parsed["prev"] == rec.prev and parsed["seq"] == rec.seq
    assert verify(path, key=key).ok
