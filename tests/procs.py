"""Our servers as test subprocesses: started with their logs in files, ready when their
readiness line appears, stopped by signal, never orphaned.

``spawn(args, log_dir)`` starts ``args`` in the repository with stdout and stderr going to
``log_dir/stdout.log`` and ``log_dir/stderr.log``. A process started from the main thread gets
SIGKILL when pytest dies (``PR_SET_PDEATHSIG``), so an aborted run leaves no orphan.
``ServiceProc`` subclasses name their readiness line (``READY``) and read its fields
(``_on_ready``); ``wait_ready`` polls the log with a deadline and fails with the process's
stderr when it exits or never becomes ready. The ready line is read as the launcher reads its
children's (``kvstore.proc.ReadyLineChild``). ``running(pid)`` and ``descendants(pid)`` tell
what is left of a process tree once a test stopped it. ``procs`` (a fixture) starts and
tracks the processes a test runs itself.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Iterator

import pytest

from kvstore.proc import ReadyLineChild, die_with_parent

__all__ = ["REPO", "ServiceProc", "spawn", "running", "descendants", "Processes", "procs", "module_procs"]

REPO = Path(__file__).resolve().parents[1]


def running(pid: int | str) -> bool:
    """Whether process ``pid`` exists and has not exited (a zombie has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` now: its children, theirs, and so on."""
    out: set[int] = set()
    todo = [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                kids = {int(k) for k in (task / "children").read_text().split()}
            except OSError:
                continue
            todo += kids - out
            out |= kids
    return out


def spawn(args: list[str], log_dir: Path, env: dict[str, str] | None = None
          ) -> tuple[subprocess.Popen, list]:
    """Start ``args`` with its output in ``log_dir``; (the process, its open log files)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    out = open(log_dir / "stdout.log", "wb")
    err = open(log_dir / "stderr.log", "wb")
    # PR_SET_PDEATHSIG follows the forking thread: only the main thread lives as long as pytest.
    main = threading.current_thread() is threading.main_thread()
    proc = subprocess.Popen(args, cwd=REPO, stdout=out, stderr=err,
                            env=os.environ.copy() if env is None else env,
                            preexec_fn=die_with_parent(signal.SIGKILL) if main else None)
    return proc, [out, err]


@dataclass
class ServiceProc(ReadyLineChild):
    """One server subprocess; subclasses set ``NAME``, ``READY`` and ``_on_ready``."""

    NAME: ClassVar[str] = "process"
    READY: ClassVar[re.Pattern[str]]
    log_offset: ClassVar[int] = 0    # stdout.log holds this start's output alone

    proc: subprocess.Popen
    log_dir: Path
    address: str = ""
    _files: list = field(default_factory=list)

    @property
    def log_path(self) -> Path:
        return self.log_dir / "stdout.log"

    @property
    def ready_pattern(self) -> re.Pattern[str]:
        return self.READY

    @property
    def stderr(self) -> str:
        return (self.log_dir / "stderr.log").read_text(errors="replace")

    def _on_ready(self, match: re.Match[str]) -> None:
        raise NotImplementedError

    def wait_ready(self, timeout: float, interval: float = 0.02):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready_match():
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.NAME} exited with {self.proc.returncode}:\n{self.stderr}")
            time.sleep(interval)
        self.kill()
        raise RuntimeError(f"{self.NAME} not ready within {timeout} s:\n{self.stderr}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        """Send ``sig`` and return the exit code; a process that ignores it for ``timeout``
        seconds is killed and the test fails with its stderr."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.NAME} ignored signal {sig} for {timeout} s:\n{self.stderr}")
        finally:
            self.kill()

    def kill(self) -> None:
        """SIGKILL if still running; close the log files. Idempotent."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._after_exit()
        for f in self._files:
            f.close()
        self._files.clear()

    def _after_exit(self) -> None:
        """What a subclass cleans up once the process is gone."""


class Processes:
    """The ``procs`` fixture: the processes one test starts itself (a CLI run, a command's
    server), each killed at the end of the test if it still runs. A test that starts a
    process asks for it, which also puts the test in the ``integration`` tier
    (``tests/conftest.py``)."""

    def __init__(self) -> None:
        self._started: list[subprocess.Popen] = []

    def popen(self, args: list[str], **kw) -> subprocess.Popen:
        """``subprocess.Popen(args, **kw)``, in the repository unless ``cwd`` says otherwise."""
        kw.setdefault("cwd", REPO)
        proc = subprocess.Popen(args, **kw)
        self._started.append(proc)
        return proc

    def run(self, args: list[str], timeout: float = 120.0, **kw) -> subprocess.CompletedProcess:
        """``subprocess.run(args, timeout=timeout, **kw)``, in the repository unless ``cwd``
        says otherwise; text output captured unless told otherwise."""
        kw.setdefault("cwd", REPO)
        if "stdout" not in kw and "stderr" not in kw:
            kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run(args, timeout=timeout, **kw)

    def close(self) -> None:
        for proc in self._started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.fixture
def procs() -> Iterator[Processes]:
    p = Processes()
    try:
        yield p
    finally:
        p.close()


@pytest.fixture(scope="module")
def module_procs() -> Iterator[Processes]:
    """``procs`` for a module-scoped fixture (its processes live as long as the module's tests)."""
    p = Processes()
    try:
        yield p
    finally:
        p.close()
