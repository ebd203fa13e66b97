"""PolicyHolder: reload on file change and SIGHUP; an invalid file never replaces the last good policy."""

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from policies import PolicyError, PolicyHolder

EXAMPLES = Path(__file__).resolve().parents[2] / "policies" / "examples"
FINANCE = (EXAMPLES / "finance.yaml").read_text()


def _write(path: Path, text: str) -> None:
    path.write_text(text)
    st = path.stat()  # make sure the mtime moves even on coarse-grained filesystems
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def test_first_load_must_be_valid(tmp_path):
    bad = tmp_path / "p.yaml"
    bad.write_text("id: x\n")
    with pytest.raises(PolicyError):
        PolicyHolder(bad)


def test_invalid_reload_keeps_last_good(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(FINANCE)
    holder = PolicyHolder(path)
    good = holder.current
    seen = []
    holder.on_change(seen.append)

    _write(path, FINANCE.replace("concurrency: 8", "concurrency: many", 1))
    result = holder.poll()
    assert result is not None and not result.changed
    assert "tenants[1].limits.concurrency" in str(result.error)
    assert holder.current is good and holder.last_error is result.error and seen == []
    assert holder.current.authenticate("sk-fin-risk-EXAMPLE-ONLY").limits.concurrency == 8

    _write(path, FINANCE.replace("concurrency: 8", "concurrency: 16", 1))
    result = holder.poll()
    assert result.changed and result.error is None and holder.last_error is None
    assert holder.current.tenant("risk").limits.concurrency == 16
    assert seen == [holder.current] and holder.current.digest != good.digest
    assert holder.poll() is None  # unchanged file: no reload


def test_deleted_file_keeps_last_good(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(FINANCE)
    holder = PolicyHolder(path)
    path.unlink()
    result = holder.poll()
    assert not result.changed and "cannot read" in str(result.error)
    assert holder.current.id == "finance-prod"


def test_watch_thread_picks_up_change(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(FINANCE)
    holder = PolicyHolder(path)
    holder.start_watching(interval_s=0.05)
    try:
        _write(path, FINANCE.replace("id: finance-prod", "id: finance-v2", 1))
        deadline = time.monotonic() + 5
        while holder.current.id != "finance-v2" and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        holder.stop()
    assert holder.current.id == "finance-v2"


def test_async_watch_and_loop_sighup(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(FINANCE)
    holder = PolicyHolder(path)

    async def main():
        loop = asyncio.get_running_loop()
        holder.install_sighup(loop)
        task = asyncio.create_task(holder.watch_async(0.02))
        try:
            _write(path, FINANCE.replace("id: finance-prod", "id: finance-async", 1))
            for _ in range(250):
                if holder.current.id == "finance-async":
                    break
                await asyncio.sleep(0.02)
            assert holder.current.id == "finance-async"
            task.cancel()  # from here on only the signal can reload
            path.write_text(FINANCE.replace("id: finance-prod", "id: finance-loop-hup", 1))
            os.kill(os.getpid(), signal.SIGHUP)
            for _ in range(250):
                if holder.current.id == "finance-loop-hup":
                    break
                await asyncio.sleep(0.02)
            assert holder.current.id == "finance-loop-hup"
        finally:
            task.cancel()
            loop.remove_signal_handler(signal.SIGHUP)

    asyncio.run(main())


def test_sighup_reloads(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(FINANCE)
    holder = PolicyHolder(path)
    previous = signal.getsignal(signal.SIGHUP)
    try:
        holder.install_sighup()
        path.write_text(FINANCE.replace("id: finance-prod", "id: finance-hup", 1))
        os.kill(os.getpid(), signal.SIGHUP)
        assert holder.current.id == "finance-hup"
        path.write_text("id: [broken\n")
        os.kill(os.getpid(), signal.SIGHUP)
        assert holder.current.id == "finance-hup" and "YAML syntax" in str(holder.last_error)
    finally:
        signal.signal(signal.SIGHUP, previous)
