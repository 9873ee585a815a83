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

A serving configuration is started the same way by every benchmark that starts one
(``serving.sweep``'s ``--launch``, ``serving.compare``, ``planner.autoscale_bench``,
``planner.stack_profile``):

- :class:`Configuration`: an endpoint already running (its URL) or a command that serves one
  (its port from the command's ``--port``), and the line its output shows once up;
- :class:`Launched`: that command started through :func:`popen` once its port is free, waited
  for (``GET /v1/models`` answers, the command still runs, its ready line printed) and stopped;
- :func:`kvrouter_up`: the ``kvrouter up`` command line those benchmarks launch, with this
  Python (``-m router.cli up``).

``REPO`` is the repository root, where the benchmarks run their children from.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

from kvstore.proc import die_with_parent, signal_group

__all__ = ["REPO", "Interrupted", "popen", "stop", "kill_pid", "run", "guard", "run_main", "port_in_use",
           "Configuration", "Launched", "kvrouter_up"]

REPO = Path(__file__).resolve().parents[1]

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


@dataclasses.dataclass(frozen=True)
class Configuration:
    name: str
    url: str | None = None  # an endpoint already running ...
    command: str | None = None  # ... or a command that starts one
    ready_pattern: str | None = None  # a line its output must show once up (None: see ready_line)

    def ready_line(self) -> str | None:
        """The regular expression of the line a launched command prints once up: given, or
        ``kvrouter up``'s own ("The router is up at URL"), else None."""
        if self.ready_pattern is not None:
            return self.ready_pattern
        argv = shlex.split(self.command or "")
        if "up" in argv and any(a.endswith("kvrouter") or a == "router.cli" for a in argv):
            return rf"^The router is up at {re.escape(self.endpoint())}\b"
        return None

    def port(self) -> int:
        return int(self.endpoint().rsplit(":", 1)[1].split("/")[0])

    def endpoint(self) -> str:
        if self.url:
            return self.url
        argv = shlex.split(self.command or "")
        port = "8000"
        for i, a in enumerate(argv):
            if a == "--port" and i + 1 < len(argv):
                port = argv[i + 1]
            elif a.startswith("--port="):
                port = a.split("=", 1)[1]
        return f"http://127.0.0.1:{int(port)}"


class Launched:
    """A configuration's server process, started in its own session (:func:`popen`) once its
    port is free, stopped with SIGTERM."""

    def __init__(self, config: Configuration, log: TextIO) -> None:
        self.config = config
        self.log = log
        if port_in_use(config.port()):
            log.close()
            raise RuntimeError(f"{config.name}: port {config.port()} is already in use before the launch "
                               "(another server, e.g. an earlier run's cluster left running); not measuring it")
        self.proc = popen(shlex.split(config.command or ""), stdout=log, stderr=subprocess.STDOUT,
                          stdin=subprocess.DEVNULL)

    def _printed_ready(self) -> bool:
        pattern = self.config.ready_line()
        if pattern is None:
            return True
        try:
            text = open(self.log.name, errors="replace").read()
        except OSError:
            return False
        return re.search(pattern, text, re.MULTILINE) is not None

    def wait_ready(self, timeout_s: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        url = self.config.endpoint() + "/v1/models"
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.config.name}: exited with {self.proc.returncode} before it was "
                                       f"ready (see {self.log.name})")
                try:
                    if self._printed_ready() and client.get(url).status_code == 200 and self.proc.poll() is None:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
        raise RuntimeError(f"{self.config.name}: not ready after {timeout_s:.0f} s (see {self.log.name})")

    def stop(self, timeout_s: float = 60.0) -> int | None:
        return stop(self.proc, timeout_s)


def kvrouter_up(model: str, port: int, log_dir: Path | str, store_memory: str, flags: str = "", *,
                request_log: Path | str | None = None, step_trace_dir: Path | str | None = None) -> str:
    """``kvrouter up``'s command line (``sys.executable -m router.cli up``): ``model`` served on
    ``port``, its logs and ``cluster.json`` in ``log_dir``, a store of ``store_memory``, then
    ``flags`` (the layout); ``request_log``: the router's request log; ``step_trace_dir``: each
    worker's steps as ``steps-ROLE-PID.jsonl`` there."""
    command = f"{sys.executable} -m router.cli up --model {model} --port {port}"
    if request_log is not None:
        command += f" --request-log {request_log}"
    command += f" --log-dir {log_dir} --store-memory {store_memory} {flags}"
    if step_trace_dir is not None:
        command += f" --worker-arg=--step-trace={step_trace_dir}/steps-{{role}}-{{pid}}.jsonl"
    return command
