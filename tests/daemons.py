"""Fixtures that run real store daemons (``python -m kvstore.daemon.cli serve``) as subprocesses
(a plugin of the root ``conftest.py``: every test package may use them).

- ``start_daemon(*args, memory="64M", ...)``: start one daemon on a free port and wait (with a
  deadline) for its readiness line; returns a ``DaemonProc``. Every daemon a test started is
  stopped at the end of the test.
- ``daemon``: one plain daemon for a test. ``shared_daemon``: one per module, for tests that
  only need a live node and clean up their own keys. ``ucx_daemon``: one per module serving
  UCX too (``--ucx``); skipped, naming why, where ``ucxx`` does not import.

No daemon outlives the test run: teardown stops every daemon even when the test failed; a
daemon started from the main thread gets SIGKILL when pytest dies (``PR_SET_PDEATHSIG``), so
an aborted run leaves no orphan (its arena goes at the next ``kvstore serve``'s start); and a
daemon a test killed with SIGKILL has its arena unlinked here, so a run leaves ``/dev/shm``
as it found it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

from tests.procs import ServiceProc, spawn

SHM_DIR = Path("/dev/shm")


@dataclass
class DaemonProc(ServiceProc):
    NAME: ClassVar[str] = "kvstore serve"
    READY: ClassVar[re.Pattern[str]] = re.compile(
        r"kvstore ready address=(\S+) node_id=(\S+) arena=(\S+) memory=\S+ metrics=(\S+)")

    node_id: str = ""
    arena: str = ""
    metrics: str | None = None

    def _on_ready(self, m: re.Match[str]) -> None:
        self.address, self.node_id, self.arena, metrics = m.groups()
        self.metrics = None if metrics == "-" else metrics

    def _after_exit(self) -> None:
        """A daemon SIGKILLed cannot unlink its arena; do it for it. (After any other exit a
        leftover arena is the daemon's bug, and tests that check for it still see it.)"""
        if self.proc.returncode != -signal.SIGKILL:
            return
        for path in SHM_DIR.glob(f"kvstore-{self.proc.pid}-*"):  # also before its ready line
            path.unlink(missing_ok=True)


class DaemonFactory:
    def __init__(self, base: Path) -> None:
        self.base = base
        self.started: list[DaemonProc] = []

    def __call__(self, *extra: str, memory: str = "64M", env: dict[str, str] | None = None,
                 timeout: float = 20.0, nofile: int | None = None) -> DaemonProc:
        """``nofile``: run the daemon under that RLIMIT_NOFILE (soft and hard, ``prlimit``)."""
        log_dir = self.base / f"daemon{len(self.started)}"
        args = [sys.executable, "-m", "kvstore.daemon.cli", "serve", "--port", "0", "--memory", memory,
                *extra]
        if nofile is not None:
            args = ["prlimit", f"--nofile={nofile}:{nofile}", "--", *args]
        full_env = {k: v for k, v in os.environ.items()
                    if k not in ("KVSTORE_AUTH_TOKEN", "KVCACHE_CLUSTER_SECRET", "KVCACHE_CLUSTER_SECRET_FILE")}
        full_env.update(env or {})
        proc, files = spawn(args, log_dir, full_env)
        d = DaemonProc(proc, log_dir, _files=files)
        self.started.append(d)
        return d.wait_ready(timeout)

    def close(self) -> None:
        """SIGTERM every daemon still running, then SIGKILL any that did not exit in 10 s."""
        for d in self.started:
            if d.proc.poll() is None:
                d.proc.terminate()
        deadline = time.monotonic() + 10
        for d in self.started:
            try:
                d.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            d.kill()


@pytest.fixture
def start_daemon(tmp_path: Path) -> Iterator[Callable[..., DaemonProc]]:
    factory = DaemonFactory(tmp_path / "daemons")
    try:
        yield factory
    finally:
        factory.close()


@pytest.fixture
def daemon(start_daemon) -> DaemonProc:
    return start_daemon()


@pytest.fixture(scope="module")
def shared_daemon(tmp_path_factory) -> Iterator[DaemonProc]:
    factory = DaemonFactory(tmp_path_factory.mktemp("shared"))
    try:
        yield factory(memory="64M")
    finally:
        factory.close()


@pytest.fixture(scope="module")
def ucx_daemon(tmp_path_factory) -> Iterator[DaemonProc]:
    from kvstore.net import ucx

    reason = ucx.available()
    if reason is not None:
        pytest.skip(reason)
    factory = DaemonFactory(tmp_path_factory.mktemp("ucx"))
    try:
        yield factory("--ucx", memory="64M")
    finally:
        factory.close()
