"""Response, tool-call and record ids: unique, 24 hex digits, unguessable, no system call per id (on the event
loop such a call gives the interpreter lock to the engine thread), and a forked child's differ from its parent's."""

from __future__ import annotations

import os
import re

from gateway.routers.chat import call_id
from gateway.schemas import _IdSource, new_id


def test_ids_are_unique_hex():
    ids = [new_id("chatcmpl") for _ in range(50_000)]
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"chatcmpl-[0-9a-f]{24}", i) for i in ids[:100])
    assert re.fullmatch(r"call_[0-9a-f]{24}", call_id())


def test_no_system_call_per_id(monkeypatch):
    source = _IdSource()
    monkeypatch.setattr(os, "urandom", lambda n: (_ for _ in ()).throw(AssertionError("urandom per id")))
    assert len({source.hex() for _ in range(1000)}) == 1000


def test_two_processes_do_not_share_ids():
    a, b = _IdSource(), _IdSource()  # each its own key: the same counter gives other ids
    assert [a.hex() for _ in range(100)] != [b.hex() for _ in range(100)]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child's first ids, from the parent's counter position
        os.write(w, " ".join(a.hex() for _ in range(10)).encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(r, 1000).decode().split()
    assert len(child) == 10 and not set(child) & {a.hex() for _ in range(10)}
