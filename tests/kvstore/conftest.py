"""Fixtures that run real store daemons (``python -m kvstore.cli serve``) as subprocesses.

- ``start_daemon(*args, memory="64M", ...)``: start one daemon on a free port and wait (with a
  deadline) for its readiness line; returns a ``DaemonProc``. Every daemon a test started is
  stopped at the end of the test.
- ``daemon``: one plain daemon for a test. ``shared_daemon``: one per module, for tests that
  only need a live node and clean up their own keys.

No daemon outlives the test run: teardown stops every daemon even when the test failed; a
daemon started from the main thread gets SIGKILL when pytest dies (``PR_SET_PDEATHSIG``), so
an aborted run leaves no orphan (its arena goes at the next ``kvstore serve``'s start); and a
daemon a test killed with SIGKILL has its arena unlinked here, so a run leaves ``/dev/shm``
as it found it.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHM_DIR = Path("/dev/shm")
_PR_SET_PDEATHSIG = 1
_READY = re.compile(r"kvstore ready address=(\S+) node_id=(\S+) arena=(\S+) memory=\S+ metrics=(\S+)")


def _die_with_pytest(parent: int) -> Callable[[], None]:
    """A preexec_fn: the child gets SIGKILL when the thread that started it dies (Linux).

    The kernel ties PR_SET_PDEATHSIG to the forking *thread*, so the factory only uses it from
    the main thread, which lives as long as pytest.
    """
    def preexec() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # pytest died before prctl took effect
            os._exit(1)
    return preexec


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
        finally:
            self._remove_killed_arena()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._remove_killed_arena()
        for f in self._logs:
            f.close()

    def _remove_killed_arena(self) -> None:
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
                 timeout: float = 20.0) -> DaemonProc:
        log_dir = self.base / f"daemon{len(self.started)}"
        log_dir.mkdir(parents=True)
        args = [sys.executable, "-m", "kvstore.cli", "serve", "--port", "0", "--memory", memory,
                *extra]
        full_env = {k: v for k, v in os.environ.items() if k != "KVSTORE_AUTH_TOKEN"}
        full_env.update(env or {})
        out = open(log_dir / "stdout.log", "wb")
        err = open(log_dir / "stderr.log", "wb")
        main = threading.current_thread() is threading.main_thread()
        proc = subprocess.Popen(args, cwd=REPO, stdout=out, stderr=err, env=full_env,
                                preexec_fn=_die_with_pytest(os.getpid()) if main else None)
        d = DaemonProc(proc, args, log_dir, _logs=[out, err])
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
