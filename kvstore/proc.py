"""Child processes: a free port to give one, a child that dies with its parent, a ready line.

What the launcher (``router.cluster``), the benchmarks and the tests share when they start our
servers as children:

- :func:`free_port`: a TCP port free right now (the OS's choice). Free only until some process
  takes it: a child given one binds it at once, and one that fails to bind says so.
- :func:`die_with_parent`: a ``preexec_fn`` that makes the child get a signal when its parent
  dies, even of SIGKILL (Linux ``PR_SET_PDEATHSIG``). The kernel ties it to the *thread* that
  forked the child, not to the process: a child started from a thread gets the signal when that
  thread ends. Callers that start children from short-lived threads leave it out there (the
  tests and ``router.cluster.hosts`` use it from the main thread only).
- :class:`ReadyLineChild`: what a child that says it serves by printing a line has in common:
  the line searched only in what *this* start of the child wrote to its log (a log appended to
  across restarts holds earlier starts' lines), the fields of the line, the log's tail. A port
  that merely answers proves nothing: another process may hold it.
- :func:`read_line`: the next line a child writes to its stdout pipe, within a deadline (its
  ready line, or its answer to a request on its stdin).
- :func:`signal_group`: a signal to the process group of a child started in a session of its
  own, whatever it started included.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import select
import socket
import subprocess
from collections.abc import Callable
from pathlib import Path

__all__ = ["free_port", "die_with_parent", "ReadyLineChild", "read_line", "signal_group"]

_PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def signal_group(pid: int, sig: int) -> None:
    """Send ``sig`` to the process group ``pid`` leads (a child started with
    ``start_new_session``: its pgid is its pid); nothing if the group is gone, or is no longer
    ours to signal (its id taken by another user's process)."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@functools.cache
def _prctl() -> Callable[..., int] | None:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):   # not Linux
        return None


def die_with_parent(sig: int) -> Callable[[], None]:
    """A ``preexec_fn``: the child gets ``sig`` when the thread that forks it ends (Linux; see
    the module docstring), and exits at once if its parent is gone before that is set (the
    signal would never come). Where there is no ``prctl`` it does nothing."""
    prctl = _prctl()   # looked up here, in the parent, not between fork and exec
    parent = os.getpid()

    def preexec() -> None:
        if prctl is None:
            return
        prctl(_PR_SET_PDEATHSIG, sig)
        if os.getppid() != parent:
            os._exit(1)
    return preexec


class ReadyLineChild:
    """A child process that says it serves by printing a line to its log.

    A subclass holds ``proc`` (None until started), ``log_path`` (the file its output goes
    to), ``ready_pattern`` (a regular expression, a string searched with ``re.MULTILINE``, or
    a compiled pattern; None: no line to wait for) and ``log_offset`` (where this start's
    output begins in the log). :meth:`ready_match` hands the line's match to
    :meth:`_on_ready`, which reads its fields."""

    proc: subprocess.Popen | None
    log_path: Path
    ready_pattern: str | re.Pattern[str] | None
    log_offset: int

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _on_ready(self, match: re.Match[str]) -> None:
        """Read the ready line's fields (a subclass's)."""

    def ready_match(self) -> re.Match[str] | None:
        """The ready line this start of the child printed, if it has (passed to
        :meth:`_on_ready` first); None until then. A child with no pattern is never ready by
        its log."""
        if self.ready_pattern is None:
            return None
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self.log_offset)
                text = log.read().decode("utf-8", "replace")
        except OSError:
            return None
        pattern = self.ready_pattern
        match = (pattern.search(text) if isinstance(pattern, re.Pattern)
                 else re.search(pattern, text, re.MULTILINE))
        if match is not None:
            self._on_ready(match)
        return match

    def log_tail(self, n_bytes: int = 2000) -> str:
        """The last ``n_bytes`` of what this start wrote to the log."""
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[max(self.log_offset, len(data) - n_bytes):].decode("utf-8", "replace")


def read_line(proc: subprocess.Popen, what: str, timeout: float) -> str:
    """The next line ``proc`` writes to its stdout (a text pipe) within ``timeout`` seconds,
    stripped. When none comes (it exited, or is silent), ``proc`` is killed and
    ``RuntimeError`` names ``what``, its exit code and the end of its stderr (if a pipe)."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    if not line:
        proc.kill()
        code = proc.wait()
        err = proc.stderr.read() if proc.stderr is not None else ""
        err = err.decode("utf-8", "replace") if isinstance(err, bytes) else err
        raise RuntimeError(f"{what} gave no line within {timeout:g} s (exit {code}): {err.strip()[-2000:]}")
    return line.strip()
