"""Audit log: hash chain, fsync policies, and verify() catching tampering, reordering and truncation."""

import argparse
import json
import os
from pathlib import Path

import pytest

from gateway import audit_cli
from gateway.audit import AuditLog, audit_data
from gateway.audit_record import AuditLogError, canonical_json, record_hash
from gateway.audit_verify import verify
from policies import load_policy

EXAMPLES = Path(__file__).resolve().parents[2] / "policies" / "examples"


def _write_log(path, n=8, fsync="never"):
    with AuditLog(path, fsync=fsync) as log:
        return [log.append("chat.completion", {"i": i, "tenant": "desk-a", "text": f"row {i}"},
                           trace_id=f"{i:032x}") for i in range(n)]


def _lines(path):
    return path.read_bytes().splitlines(keepends=True)


def test_chain_links_and_verifies(tmp_path):
    path = tmp_path / "audit.jsonl"
    records = _write_log(path)
    assert [r.seq for r in records] == list(range(8))
    assert records[0].prev == "0" * 64 and all(b.prev == a.hash for a, b in zip(records, records[1:], strict=False))
    rec = json.loads(_lines(path)[3])
    assert rec["trace_id"] == f"{3:032x}" and rec["hash"] == record_hash(rec)
    result = verify(path)
    assert result.ok and result.records == 8 and result.head_hash == records[-1].hash


def test_reopen_continues_chain(tmp_path):
    path = tmp_path / "audit.jsonl"
    first = _write_log(path, 3)
    with AuditLog(path, fsync="never") as log:
        nxt = log.append("x", {})
    assert nxt.seq == 3 and nxt.prev == first[-1].hash
    assert verify(path).ok and verify(path).records == 4


def test_tampered_record_detected(tmp_path):
    path = tmp_path / "audit.jsonl"
    _write_log(path)
    lines = _lines(path)
    lines[3] = lines[3].replace(b'"row 3"', b'"row 9"')
    path.write_bytes(b"".join(lines))
    result = verify(path)
    assert not result.ok and result.first_bad_index == 3 and result.reason.startswith("tampered")
    assert result.records == 3


def test_rehashed_tamper_breaks_the_next_link(tmp_path):
    path = tmp_path / "audit.jsonl"
    _write_log(path)
    lines = _lines(path)
    rec = json.loads(lines[3])
    rec["data"]["text"] = "forged"
    rec["hash"] = record_hash(rec)  # a forger who recomputes the record's own hash
    lines[3] = canonical_json(rec) + b"\n"
    path.write_bytes(b"".join(lines))
    result = verify(path)
    assert not result.ok and result.first_bad_index == 4 and result.reason.startswith("chain broken")


def test_rehashed_tamper_of_last_record_caught_by_head(tmp_path):
    path = tmp_path / "audit.jsonl"
    _write_log(path)
    lines = _lines(path)
    rec = json.loads(lines[-1])
    rec["data"]["text"] = "forged"
    rec["hash"] = record_hash(rec)
    lines[-1] = canonical_json(rec) + b"\n"
    path.write_bytes(b"".join(lines))
    result = verify(path)
    assert not result.ok and result.first_bad_index == 7 and "head checkpoint" in result.reason


def test_reordered_records_detected(tmp_path):
    path = tmp_path / "audit.jsonl"
    _write_log(path)
    lines = _lines(path)
    lines[2], lines[5] = lines[5], lines[2]
    path.write_bytes(b"".join(lines))
    result = verify(path)
    assert not result.ok and result.first_bad_index == 2
    assert "found seq 5" in result.reason and "reordered" in result.reason


def test_removed_record_detected(tmp_path):
    path = tmp_path / "audit.jsonl"
    _write_log(path)
    lines = _lines(path)
    del lines[4]
    path.write_bytes(b"".join(lines))
    result = verify(path)
    assert not result.ok and result.first_bad_index == 4
    assert "expected seq 4, found seq 5" in result.reason and "removed" in result.reason


def test_torn_tail_detected_then_quarantined_on_open(tmp_path, capsys):
    path = tmp_path / "audit.jsonl"
    records = _write_log(path)
    data = path.read_bytes()
    path.write_bytes(data[:-20])  # a crash tore the last record
    result = verify(path)
    assert not result.ok and result.first_bad_index == 7 and result.reason.startswith("truncated")
    torn = data[data.rindex(b"\n", 0, len(data) - 1) + 1:-20]
    with AuditLog(path, fsync="always") as log:  # starts: the torn bytes go aside, the chain goes on
        nxt = log.append("chat.completion", {"after": "restart"})
    asides = list(tmp_path.glob("audit.jsonl.torn-*"))
    assert len(asides) == 1 and asides[0].read_bytes() == torn
    lines = [json.loads(line) for line in _lines(path)]
    assert [r["seq"] for r in lines] == list(range(9)) and lines[7]["event"] == "audit.quarantine"
    assert lines[7]["prev"] == records[6].hash and nxt.seq == 8
    assert lines[7]["data"]["bytes"] == len(torn) and lines[7]["data"]["file"] == asides[0].name
    result = verify(path)
    assert result.ok and result.records == 9
    assert [(q["index"], q["bytes"], q["kept"]) for q in result.quarantined] == [(7, len(torn), True)]
    assert _cli(["audit", "verify", str(path)]) == 0
    assert f"record 7: a torn tail of {len(torn)} bytes was quarantined in {asides[0]} (kept)" in capsys.readouterr().out
    asides[0].write_bytes(b"other")
    assert verify(path).quarantined[0]["kept"] is False


def test_altered_last_record_still_blocks_appends(tmp_path):
    path = tmp_path / "audit.jsonl"
    _write_log(path)
    path.write_bytes(path.read_bytes().replace(b'"row 7"', b'"row 9"'))
    with pytest.raises(AuditLogError, match="does not verify"):
        AuditLog(path)


def test_truncated_whole_records_detected_by_head(tmp_path):
    path = tmp_path / "audit.jsonl"
    _write_log(path)
    path.write_bytes(b"".join(_lines(path)[:5]))
    result = verify(path)
    assert not result.ok and result.first_bad_index == 5 and "seq 7" in result.reason
    # without the checkpoint a clean prefix is indistinguishable from a shorter log
    assert verify(path, use_head=False).ok


def test_second_writer_refused(tmp_path):
    path = tmp_path / "audit.jsonl"
    with AuditLog(path, fsync="never"):
        with pytest.raises(AuditLogError, match="another writer"):
            AuditLog(path)


def test_non_finite_data_rejected(tmp_path):
    with AuditLog(tmp_path / "a.jsonl", fsync="never") as log:
        with pytest.raises(AuditLogError, match="finite"):
            log.append("x", {"v": float("nan")})
        assert log.append("x", {"v": 1.5}).seq == 0  # the rejected record consumed no seq


@pytest.mark.parametrize(("policy", "during", "at_close"), [("always", 5, 1), ("never", 0, 0), ("interval", 0, 1)])
def test_fsync_policies(tmp_path, monkeypatch, policy, during, at_close):
    calls = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real(fd)))
    log = AuditLog(tmp_path / "a.jsonl", fsync=policy, fsync_interval_s=3600)
    fd = log._file.fileno()
    for i in range(5):
        log.append("x", {"i": i})
    assert calls.count(fd) == during  # fsyncs of the log file itself (the head checkpoint is another fd)
    log.close()
    assert calls.count(fd) == during + at_close
    assert verify(tmp_path / "a.jsonl").ok


def test_interval_background_sync(tmp_path, monkeypatch):
    import time

    calls = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real(fd)))
    log = AuditLog(tmp_path / "a.jsonl", fsync="interval", fsync_interval_s=0.05)
    log.append("x", {})
    deadline = time.monotonic() + 5
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls  # synced without another append
    log.close()


def test_audit_levels_and_redaction():
    r = load_policy(EXAMPLES / "finance.yaml").resolve("risk", "/v1/chat/completions", "qwen3-moe")
    meta = {"tenant": r.tenant_id, "policy": r.policy_digest}
    content = {"prompt": "wire to DE44500105175407324931", "completion": "ok"}
    full = audit_data(r.audit_level, meta, content, r.redact)
    assert full["prompt"] == "wire to [IBAN]" and full["tenant"] == "risk"
    hashed = audit_data("metadata", meta, content)
    assert "prompt" not in hashed and len(hashed["prompt_sha256"]) == 64
    assert audit_data("off", meta, content) is None


def _cli(argv):
    parser = argparse.ArgumentParser(prog="moegate")
    audit_cli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_verify(tmp_path, capsys):
    path = tmp_path / "audit.jsonl"
    _write_log(path)
    assert _cli(["audit", "verify", str(path)]) == 0
    assert "ok: 8 records" in capsys.readouterr().out
    lines = _lines(path)
    lines[2], lines[3] = lines[3], lines[2]
    path.write_bytes(b"".join(lines))
    assert _cli(["audit", "verify", str(path)]) == 1
    assert f"{path}: record 2 (line 3): out of sequence" in capsys.readouterr().err


KEY = b"k" * 32


def test_keyed_chain_needs_the_key(tmp_path, monkeypatch, capsys):
    path = tmp_path / "audit.jsonl"
    with AuditLog(path, fsync="never", key=KEY) as log:
        for i in range(4):
            log.append("x", {"i": i})
    assert all(json.loads(line)["v"] == 2 for line in _lines(path))
    result = verify(path, key=KEY)
    assert result.ok and result.keyed_records == 4 and result.chain == "keyed (HMAC-SHA256)"
    no_key = verify(path)
    assert not no_key.ok and no_key.first_bad_index == 0 and no_key.reason.startswith("keyed")
    assert not verify(path, key=b"another key").ok
    with pytest.raises(AuditLogError, match="MOEGATE_AUDIT_KEY"):
        AuditLog(path)
    with pytest.raises(AuditLogError, match="another key"):
        AuditLog(path, key=b"another key")
    # a forger without the key: an edited record rehashed with sha256 reads as a downgrade
    lines = _lines(path)
    rec = json.loads(lines[2])
    rec["data"]["i"], rec["v"] = 99, 1
    rec["hash"] = record_hash(rec)
    forged = tmp_path / "forged.jsonl"
    forged.write_bytes(b"".join([*lines[:2], canonical_json(rec) + b"\n", *lines[3:]]))
    assert verify(forged, key=KEY, use_head=False).reason.startswith("downgraded")
    # ... and a whole chain rewritten unkeyed verifies only without the key
    rewritten = tmp_path / "rewritten.jsonl"
    _write_log(rewritten, 4)
    assert verify(rewritten).ok
    assert verify(rewritten, key=KEY).reason.startswith("not keyed")
    # the CLI takes the key from the environment or a file, and says the chain is keyed
    monkeypatch.setenv("MOEGATE_AUDIT_KEY", KEY.decode())
    assert _cli(["audit", "verify", str(path)]) == 0
    assert "ok: 4 records, keyed (HMAC-SHA256)" in capsys.readouterr().out
    monkeypatch.delenv("MOEGATE_AUDIT_KEY")
    (tmp_path / "key").write_bytes(KEY + b"\n")
    assert _cli(["audit", "verify", "--key-file", str(tmp_path / "key"), str(path)]) == 0
    assert _cli(["audit", "verify", str(path)]) == 1
    assert "give its key" in capsys.readouterr().err


def test_unkeyed_log_continues_keyed(tmp_path):
    path = tmp_path / "audit.jsonl"
    _write_log(path, 3)
    with AuditLog(path, fsync="never", key=KEY) as log:
        log.append("x", {})
    result = verify(path, key=KEY)
    assert result.ok and result.keyed_records == 1 and result.chain.startswith("3 unkeyed records, then keyed")


def test_lone_surrogates_are_escaped_not_fatal(tmp_path):
    path = tmp_path / "audit.jsonl"
    odd = {"user": "\ud800", "stop": ["a\udfffb"], "pair": "\ud83d\ude00", "emoji": "\U0001f600", "text": "é"}
    with AuditLog(path, fsync="never", key=KEY) as log:
        log.append("x", odd)
        log.append("x", {"after": 1})
    raw = path.read_bytes()
    raw.decode("utf-8")  # valid UTF-8 on disk
    assert b"\\ud800" in raw and "é".encode() in raw
    rec = json.loads(_lines(path)[0])
    assert rec["data"]["user"] == "\ud800" and rec["data"]["stop"] == ["a\udfffb"]
    assert rec["data"]["pair"] == "\U0001f600"  # as any JSON reader pairs them
    assert verify(path, key=KEY).ok
    meta = audit_data("metadata", {}, {"input": "\ud800"})
    assert len(meta["input_sha256"]) == 64


def test_fsync_never_still_detects_a_cut_tail(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = AuditLog(path, fsync="never")
    for i in range(6):
        log.append("x", {"i": i})
    # the process dies here (no close); later the file loses its last two records
    path.write_bytes(b"".join(_lines(path)[:4]))
    result = verify(path)
    assert not result.ok and "seq 5" in result.reason and result.reason.startswith("truncated")
    log._file.close()


@pytest.mark.parametrize(("policy", "in_thread"), [("always", True), ("interval", False), ("never", False)])
def test_aappend_runs_on_the_loop_unless_it_may_wait_on_the_disk(tmp_path, monkeypatch, policy, in_thread):
    """`aappend` appends on the event loop where it cannot fsync (`interval` leaves the sync to its thread), in a
    worker thread for `always` and while another append or a sync holds the lock; the chain is the same."""
    import asyncio
    import threading

    synced_on = []  # the thread of each fsync of the log file
    real = os.fsync
    log = AuditLog(tmp_path / "a.jsonl", fsync=policy, fsync_interval_s=0.01)
    fd, appended_on = log._file.fileno(), []
    monkeypatch.setattr(os, "fsync", lambda f: (synced_on.append(threading.current_thread()) if f == fd else None,
                                                real(f)))
    append = log._append_locked
    monkeypatch.setattr(log, "_append_locked", lambda *a, **k: (appended_on.append(threading.current_thread()),
                                                                append(*a, **k))[1])
    free = []  # per append on the loop: whether the lock was free (the `interval` syncer may hold it)

    class Lock:
        def __init__(self, lock):
            self.lock = lock

        def acquire(self, blocking=True, timeout=-1):
            got = self.lock.acquire(blocking, timeout)
            if not blocking and threading.current_thread() is threading.main_thread():
                free.append(got)
            return got

        def release(self):
            self.lock.release()

        def __enter__(self):
            return self.lock.__enter__()

        def __exit__(self, *exc):
            return self.lock.__exit__(*exc)

    log._lock = Lock(log._lock)

    async def main():
        recs = []
        for i in range(3):
            recs.append(await log.aappend("x", {"i": i}))
            await asyncio.sleep(0.02)  # interval: each append is past its interval
        with log._lock:  # held (a sync in progress): the record waits in a thread, not on the loop
            pending = asyncio.ensure_future(log.aappend("x", {"i": 3}))
            await asyncio.sleep(0.05)
            assert not pending.done()
        return [*recs, await pending]

    recs = asyncio.run(main())
    assert [r.seq for r in recs] == [0, 1, 2, 3]
    main_thread = threading.main_thread()
    on_loop = [t is main_thread for t in appended_on]
    if in_thread:
        assert on_loop == [False] * 4 and not free  # `always` never tries the loop
    else:  # on the loop exactly where the lock was free (under load the syncer's fsync may hold it)
        assert free[3] is False and on_loop == free and any(free[:3]), (on_loop, free)
    assert main_thread not in synced_on  # nothing on the loop waits on the disk
    assert len(synced_on) >= (4 if policy == "always" else 1 if policy == "interval" else 0)
    log.close()
    assert verify(tmp_path / "a.jsonl").ok
