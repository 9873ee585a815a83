"""Fixtures that run real store daemons (``python -m kvstore.cli serve``) as subprocesses.

- ``start_daemon(*args, memory="64M", ...)``: start one daemon on a free port and wait (with a
  deadline) for its readiness line; returns a ``DaemonProc``. Every daemon a test started is
  stopped at the end of the test.
- ``daemon``: one plain daemon for a test. ``shared_daemon``: one per module, for tests that
  only need a live node and clean up their own keys.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_READY = re.compile(r"kvstore ready address=(\S+) node_id=(\S+) arena=(\S+) memory=\S+ metrics=(\S+)")


@dataclass
class DaemonProc:
    proc: subprocess.Popen
    args: list[str]
    log_dir: Path
    address: str = ""
    node_id: str = ""
    arena: str = ""
    metrics: str | None = None
    _logs: list = field(default_factory=list)

    @property
    def stderr(self) -> str:
        return (self.log_dir / "stderr.log").read_text(errors="replace")

    def wait_ready(self, timeout: float) -> "DaemonProc":
        out = self.log_dir / "stdout.log"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = _READY.search(out.read_text(errors="replace"))
            if m:
                self.address, self.node_id, self.arena, metrics = m.groups()
                self.metrics = None if metrics == "-" else metrics
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvstore serve exited with {self.proc.returncode}:\n{self.stderr}")
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"kvstore serve not ready within {timeout} s:\n{self.stderr}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"daemon ignored signal {sig} for {timeout} s:\n{self.stderr}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for f in self._logs:
            f.close()


class DaemonFactory:
    def __init__(self, base: Path) -> None:
        self.base = base
        self.started: list[DaemonProc] = []

    def __call__(self, *extra: str, memory: str = "64M", env: dict[str, str] | None = None,
                 timeout: float = 20.0) -> DaemonProc:
        log_dir = self.base / f"daemon{len(self.started)}"
        log_dir.mkdir(parents=True)
        args = [sys.executable, "-m", "kvstore.cli", "serve", "--port", "0", "--memory", memory,
                *extra]
        full_env = {k: v for k, v in os.environ.items() if k != "KVSTORE_AUTH_TOKEN"}
        full_env.update(env or {})
        out = open(log_dir / "stdout.log", "wb")
        err = open(log_dir / "stderr.log", "wb")
        proc = subprocess.Popen(args, cwd=REPO, stdout=out, stderr=err, env=full_env)
        d = DaemonProc(proc, args, log_dir, _logs=[out, err])
        self.started.append(d)
        return d.wait_ready(timeout)

    def close(self) -> None:
        for d in self.started:
            if d.proc.poll() is None:
                d.proc.terminate()
                try:
                    d.proc.wait(10)
                except subprocess.TimeoutExpired:
                    pass
            d.kill()


@pytest.fixture
def start_daemon(tmp_path: Path) -> Iterator[Callable[..., DaemonProc]]:
    factory = DaemonFactory(tmp_path / "daemons")
    yield factory
    factory.close()


@pytest.fixture
def daemon(start_daemon) -> DaemonProc:
    return start_daemon()


@pytest.fixture(scope="module")
def shared_daemon(tmp_path_factory) -> Iterator[DaemonProc]:
    factory = DaemonFactory(tmp_path_factory.mktemp("shared"))
    yield factory(memory="64M")
    factory.close()
