"""``EtcdServer``: one real single-member etcd on loopback ports with its own data directory,
for the tests (the ``etcd`` and ``etcd_server`` fixtures of tests/conftest.py start them).

etcd runs with a 50 ms heartbeat and a 500 ms election timeout, so its minimum lease TTL is
1 s (the default would round a 1 s TTL up to 2 s) and tests of expiry stay short. A first start
whose ports were taken meanwhile tries again on new ports; a restart keeps its ports. The
server's output goes to ``<data_dir>.log`` next to its data directory, and it gets SIGTERM
when pytest dies, so an aborted run leaks no etcd.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from kvstore.proc import die_with_parent
from kvstore.proc import free_port as _free_port

__all__ = ["ETCD_BIN", "EtcdServer"]

ETCD_BIN = shutil.which("etcd") or "/usr/bin/etcd"


class _PortTaken(RuntimeError):
    """etcd could not bind a port it was given."""


class EtcdServer:
    """One single-member etcd on loopback ports with its own data directory."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.client_port = _free_port()
        self.peer_port = _free_port()
        self.url = f"http://127.0.0.1:{self.client_port}"
        self.proc: subprocess.Popen | None = None
        self._log = data_dir.parent / f"{data_dir.name}.log"
        self._started = False

    def start(self, timeout: float = 20.0) -> "EtcdServer":
        """Start and wait until it answers. A first start whose ports were taken meanwhile (a
        port found free is free only until some process, often an outgoing connection's
        ephemeral port, takes it) tries again on new ports, twice at most; a restart keeps
        its ports, which clients know."""
        for attempt in range(3):
            try:
                return self._start(timeout)
            except _PortTaken:
                if self._started or attempt == 2:
                    raise
                shutil.rmtree(self.data_dir, ignore_errors=True)
                self.client_port, self.peer_port = _free_port(), _free_port()
                self.url = f"http://127.0.0.1:{self.client_port}"
        raise AssertionError("unreachable")

    def _start(self, timeout: float) -> "EtcdServer":
        assert self.proc is None, "already running"
        if not os.path.exists(ETCD_BIN):
            pytest.fail("etcd is not installed: run the set-up script (apt-get install etcd-server)")
        peer = f"http://127.0.0.1:{self.peer_port}"
        cmd = [
            ETCD_BIN, "--name", "test", "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"test={peer}",
            "--heartbeat-interval", "50", "--election-timeout", "500",
        ]
        seen = self._log.stat().st_size if self._log.exists() else 0   # this start's lines follow
        with open(self._log, "ab") as log:
            # SIGTERM when pytest dies, so an aborted run leaks no etcd
            self.proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent(signal.SIGTERM)
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                code, self.proc = self.proc.returncode, None
                if b"address already in use" in self._log.read_bytes()[seen:]:
                    raise _PortTaken(f"etcd exited with {code}: a port was taken; see {self._log}")
                raise RuntimeError(f"etcd exited with {code}; see {self._log}")
            try:
                r = httpx.post(f"{self.url}/v3/kv/range", json={"key": "AA=="}, timeout=0.5)
                if r.status_code == 200:
                    self._started = True
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"etcd did not become ready in {timeout} s; see {self._log}")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> "EtcdServer":
        self.stop()
        return self.start()
