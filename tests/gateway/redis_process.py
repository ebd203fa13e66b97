"""A real redis-server for tests: free loopback port, temp dir, no persistence; kill() and start() again."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest


def redis_binary() -> str:
    path = shutil.which("redis-server")
    if path is None:
        pytest.skip("redis-server binary not found: install it (`apt-get install -y redis-server`) to run the "
                    "redis store tests")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisProcess:
    def __init__(self, workdir: Path, port: int | None = None):
        self.binary = redis_binary()
        self.workdir, self.port = workdir, port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
             "--save", "", "--appendonly", "no", "--protected-mode", "no", "--daemonize", "no",
             "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {self.proc.stderr.read().decode(errors='replace')}")
            if self.ping():
                return
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout_s}s")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def command(self, *args: str) -> bytes:
        """Send one command (inline RESP array) and return the raw reply."""
        payload = f"*{len(args)}\r\n" + "".join(f"${len(a.encode())}\r\n{a}\r\n" for a in args)
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
            s.sendall(payload.encode())
            return s.recv(65536)

    def pause(self) -> None:
        """SIGSTOP: the server hangs (its socket still accepts connections, nothing answers)."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL, like a crash: no clean shutdown."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()
        self.proc = None
