"""What a benchmark starts, it stops: however the benchmark itself is stopped.

- :func:`popen` starts a child in its own session (process group) with
  ``PR_SET_PDEATHSIG = SIGTERM`` (``kvstore.proc.die_with_parent``: the child is told to stop
  if the benchmark dies, even of SIGKILL) and remembers it;
- :func:`guard` turns SIGTERM and SIGINT into :class:`Interrupted` (so ``finally`` blocks run)
  and, on the way out for any reason (an exception, a signal, a normal end), stops every child
  :func:`popen` started that still runs: SIGTERM to its group, SIGKILL after a grace period;
- :func:`run_main` runs a benchmark's ``main`` under :func:`guard` and exits 128 + the signal
  number when a signal stopped it;
- :func:`run` is ``subprocess.run(capture_output=True, text=True)`` on such a child;
- :func:`port_in_use` tells whether something already listens where a benchmark's server is
  to listen (an earlier run's cluster, left running): then the benchmark must not measure it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvstore.proc import die_with_parent, signal_group

__all__ = ["Interrupted", "popen", "stop", "kill_pid", "run", "guard", "run_main", "port_in_use"]

_started: list[subprocess.Popen] = []


class Interrupted(BaseException):
    """The benchmark got SIGTERM or SIGINT (``signum``)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    def __str__(self) -> str:
        return f"interrupted by {signal.Signals(self.signum).name}"


def popen(argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen(argv, **kwargs)`` in a new session, dying with the benchmark, and
    stopped by :func:`guard` if still running when the benchmark ends."""
    proc = subprocess.Popen(list(argv), start_new_session=True, preexec_fn=die_with_parent(signal.SIGTERM),
                            **kwargs)
    _started.append(proc)
    return proc


def stop(proc: subprocess.Popen, timeout: float = 30.0) -> int | None:
    """SIGTERM ``proc``'s group, wait up to ``timeout``, then SIGKILL the group; its exit code."""
    if proc.poll() is None:
        signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            signal_group(proc.pid, signal.SIGKILL)
            proc.wait(10)
    signal_group(proc.pid, signal.SIGKILL)   # anything its group left behind
    if proc in _started:
        _started.remove(proc)
    return proc.returncode


def kill_pid(pid: int, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to one process (not its group), if it is still there."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def run(argv: Sequence[str], timeout: float | None = None, **kwargs: Any) -> subprocess.CompletedProcess:
    """Run ``argv`` to its end, output captured as text; stopped if the benchmark is."""
    proc = popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        stop(proc, 10)
    return subprocess.CompletedProcess(list(argv), proc.returncode, out, err)


@contextlib.contextmanager
def guard(stop_timeout: float = 60.0) -> Iterator[None]:
    """SIGTERM/SIGINT raise :class:`Interrupted`; every child still running stops on exit."""
    def on_signal(signum: int, _frame: object) -> None:
        raise Interrupted(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s in previous:          # stopping is not to be interrupted in its turn
            signal.signal(s, signal.SIG_IGN)
        for proc in reversed(list(_started)):
            stop(proc, stop_timeout)
        for s, handler in previous.items():
            signal.signal(s, handler)


def run_main(main: Callable[[], object]) -> int:
    """``main()`` under :func:`guard`; 128 + signal number if a signal stopped it, else 0
    (``SystemExit`` passes through)."""
    try:
        with guard():
            main()
    except Interrupted as stopped:
        print(f"{os.path.basename(sys.argv[0])}: {stopped}; stopped every process it started",
              file=sys.stderr)
        return 128 + stopped.signum
    return 0


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts connections on ``host:port`` now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        return s.connect_ex((host, port)) == 0
