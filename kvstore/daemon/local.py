"""A ``kvstore serve`` child on loopback, for tools and benchmarks that need a real daemon.

``start_local(memory, ...)`` runs ``python -m kvstore.daemon.cli serve --host 127.0.0.1 --port 0
--memory MEMORY --log-level WARNING [extra...]`` and reads its first stdout line, the ready line
(``kvstore ready address=HOST:PORT node_id=...``); it returns the process and the address, or
raises ``RuntimeError`` with the line it got instead. Without ``secret_file`` the child's
environment loses the cluster-secret variables (``KVCACHE_CLUSTER_SECRET*``, ``KVSTORE_AUTH*``),
so a secret the caller's shell holds does not lock out clients that were not given it; with it,
``--cluster-secret-file`` is passed. ``popen`` is how the child is started (a benchmark's
``benchmarks.lifecycle.popen``, which stops it with the benchmark); ``stop_local`` ends it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

__all__ = ["start_local", "stop_local"]

_READY = re.compile(r"kvstore ready address=(\S+)")


def start_local(memory: str, *, extra: Sequence[str] = (), secret_file: str | Path | None = None,
                popen: Callable[..., subprocess.Popen] = subprocess.Popen, cwd: str | Path | None = None,
                stderr: IO[Any] | int | None = None, log_level: str = "WARNING") -> tuple[subprocess.Popen, str]:
    """Start the daemon and wait for its ready line (module docstring): (process, address)."""
    argv = [sys.executable, "-m", "kvstore.daemon.cli", "serve", "--host", "127.0.0.1", "--port", "0",
            "--memory", memory, "--log-level", log_level, *extra]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVCACHE_CLUSTER_SECRET", "KVSTORE_AUTH"))}
    if secret_file is not None:
        argv += ["--cluster-secret-file", str(secret_file)]
    proc = popen(argv, stdout=subprocess.PIPE, text=True, env=env, cwd=cwd, stderr=stderr)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    m = _READY.search(line)
    if not m:
        stop_local(proc)
        raise RuntimeError(f"kvstore serve did not start: {line!r}")
    return proc, m.group(1)


def stop_local(proc: subprocess.Popen, timeout: float = 10.0) -> int | None:
    """SIGTERM, then SIGKILL after ``timeout``; closes its stdout; its exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
    return proc.returncode
