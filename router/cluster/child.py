"""One child process of the local cluster: its own session, its own log, its own word for ready.

- Every child runs in its own session (process group): stopping it signals the whole group
  (SIGTERM, then SIGKILL after a timeout), so nothing a child started survives.
- Every child gets ``PR_SET_PDEATHSIG = SIGTERM`` (``kvstore.proc.die_with_parent``): if the
  launcher dies (even of SIGKILL) its direct children are told to stop; no orphans.
- Readiness is the child's own (``kvstore.proc.ReadyLineChild``): ``ready_pattern`` is a
  regular expression for the line the child prints once it serves (``kvengine ready
  address=...``, ``kvstore ready address=...``), searched only in what *this* start of the
  child wrote to its log (the log is appended to across restarts). A port that merely answers
  proves nothing: another process may hold it.
- ``deliberate`` marks a stop the cluster asked for (:meth:`LocalCluster.stop_child`); a
  supervisor does not restart such a child.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.proc import ReadyLineChild, die_with_parent, signal_group

__all__ = ["ChildProcess", "port_taken", "parse_cpus"]


def port_taken(host: str, port: int) -> bool:
    """Whether ``host:port`` cannot be bound now the way the children bind (``SO_REUSEADDR``:
    a port with only closing connections counts as free, one with a listener does not)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def parse_cpus(text: str) -> frozenset[int]:
    """A CPU list as ``taskset -c`` takes it (``"0"``, ``"0,2"``, ``"0-3"``) -> CPU ids."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"not a CPU list: {text!r} (want e.g. 0 or 0,1 or 0-3)") from None
    if not cpus or min(cpus) < 0:
        raise ValueError(f"not a CPU list: {text!r} (want e.g. 0 or 0,1 or 0-3)")
    return frozenset(cpus)


def _child_setup(cpus: frozenset[int] | None) -> Callable[[], None]:
    set_pdeathsig = die_with_parent(signal.SIGTERM)

    def setup() -> None:  # between fork and exec
        set_pdeathsig()
        if cpus:
            os.sched_setaffinity(0, cpus)
    return setup


@dataclass
class ChildProcess(ReadyLineChild):
    """One child in its own process group, its output appended to ``log_path``.

    ``kind`` is what it is (``etcd``, ``store``, ``prefill``, ``decode``, ``colocated``,
    ``router``); ``address`` where it serves; ``member_id`` the id its ready line gave (a
    worker's ``worker_id``, a store's ``node_id``), new at every start."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    cpus: frozenset[int] | None = None   # pinned to these CPUs (None: not pinned)
    kind: str = ""
    address: str = ""
    ready_pattern: str | re.Pattern[str] | None = None   # the child's ready line (None: none to wait for)
    unset_env: tuple[str, ...] = ()      # variables of the launcher's environment not handed on
    proc: subprocess.Popen | None = None
    member_id: str | None = None
    starts: int = 0
    deliberate: bool = False             # stopped on purpose: not to be restarted
    log_offset: int = field(default=0, init=False)   # where this start's output begins in the log
    _terminated_pid: int | None = None   # the process SIGTERM was sent to (once per process)

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if k not in self.unset_env}
        env.update(self.env)
        self.deliberate = False
        self.member_id = None
        with open(self.log_path, "ab") as log:
            self.log_offset = log.tell()
            self.proc = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=env, start_new_session=True, preexec_fn=_child_setup(self.cpus))
        self.starts += 1

    def _on_ready(self, match: re.Match[str]) -> None:
        """The ready line's named group ``id`` becomes ``member_id``."""
        if "id" in match.groupdict():
            self.member_id = match.group("id")

    def signal_group(self, sig: int) -> None:
        if self.proc is not None:
            signal_group(self.proc.pid, sig)

    def terminate(self) -> None:
        """SIGTERM the group once: a second SIGTERM could reach a worker after its drain, once
        its handler is gone, and kill it mid-shutdown (exit -15)."""
        if self.proc is not None and self.proc.pid != self._terminated_pid:
            self._terminated_pid = self.proc.pid
            self.signal_group(signal.SIGTERM)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM the group (unless ``terminate`` already did), wait up to ``timeout``, then
        SIGKILL it. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.signal_group(signal.SIGKILL)
                self.proc.wait()
        # Anything left in the group (a grandchild that ignored SIGTERM) goes too.
        self.signal_group(signal.SIGKILL)
        return self.proc.returncode
