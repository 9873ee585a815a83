"""Session-wide fixtures shared by every test package, and the test tiers.

Tiers: a test that starts a real process (etcd, a store daemon, a worker, a cluster, a
namespace host, a command) is ``integration``, one that needs the real default model is
``slow``; both are derived here from the fixtures the test uses (``PROCESS_FIXTURES``,
``SLOW_FIXTURES``), never written by hand on a test that uses them. The rest is the fast tier,
``pytest -m "not slow and not integration"``: in-process only. A fast-tier test that starts a
process anyway fails, naming the fixture it should use (``procs`` for a command it runs); only
the tools in ``TOOLS`` may run there.

Fixtures from plugins: ``start_daemon``, ``daemon``, ``shared_daemon``, ``ucx_daemon``
(tests/daemons.py), ``hosts`` (tests/hosts_fixture.py), ``procs`` and ``module_procs``
(tests/procs.py).

- ``free_port``: a function returning a currently free TCP port on 127.0.0.1.
- ``etcd``: the client URL of one real etcd server for the whole session (tests isolate
  themselves by using a unique key prefix, e.g. ``unique_prefix``).
- ``etcd_server``: a factory of private etcd servers (``EtcdServer``) that a test may stop
  and restart; each is stopped at the end of the test.
- ``hosts``: a factory of N hosts in network namespaces (``hosts(n)``, tests/hosts_fixture.py).

etcd runs with a 50 ms heartbeat and a 500 ms election timeout, so its minimum lease TTL is
1 s (the default would round a 1 s TTL up to 2 s) and tests of expiry stay short.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from kvstore.proc import die_with_parent
from kvstore.proc import free_port as _free_port

pytest_plugins = ["tests.procs", "tests.daemons", "tests.hosts_fixture"]

ETCD_BIN = shutil.which("etcd") or "/usr/bin/etcd"

# Fixtures that start real processes, and those that load the real default model: a test that
# uses one (directly or through another fixture) is in the integration or slow tier.
PROCESS_FIXTURES = frozenset({"etcd", "etcd_server", "start_daemon", "daemon", "shared_daemon",
                              "ucx_daemon", "hosts", "procs", "module_procs", "cluster_factory",
                              "vllm_pd"})
SLOW_FIXTURES = frozenset({"smollm2_dir"})
# Tools an in-process test may run: the C compiler of the native kernels (once per build),
# openssl for test certificates (kvstore.certs), ldconfig (importing torch asks it for libraries).
TOOLS = frozenset({"cc", "gcc", "clang", "openssl", "ldconfig"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        if used & PROCESS_FIXTURES:
            item.add_marker(pytest.mark.integration)
        if used & SLOW_FIXTURES:
            item.add_marker(pytest.mark.slow)


def _fast(item: pytest.Item) -> bool:
    return not {m.name for m in item.iter_markers()} & {"integration", "slow", "gpu"}


@contextmanager
def _no_process(item: pytest.Item) -> Iterator[None]:
    """In the fast tier, starting a process (but a tool of ``TOOLS``) fails the test."""
    if not _fast(item):
        yield
        return
    execute = subprocess.Popen._execute_child

    def refuse(self, args, *rest, **kw):
        if Path(str(args[0] if isinstance(args, (list, tuple)) else args).split()[0]).name in TOOLS:
            return execute(self, args, *rest, **kw)
        raise AssertionError(f"a fast-tier test started a process ({args!r}): start it through "
                             f"a fixture of the integration tier (procs, start_daemon, etcd, ...: "
                             f"tests/conftest.py)")
    subprocess.Popen._execute_child = refuse  # type: ignore[method-assign]
    try:
        yield
    finally:
        subprocess.Popen._execute_child = execute  # type: ignore[method-assign]


# Every phase, so that fixtures of any scope are held to it too.
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    with _no_process(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    with _no_process(item):
        yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item):
    with _no_process(item):
        yield


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


@pytest.fixture(scope="session")
def free_port() -> Callable[[], int]:
    return _free_port


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = EtcdServer(tmp_path_factory.mktemp("etcd-session") / "data").start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def etcd_server(tmp_path: Path) -> Iterator[Callable[[], EtcdServer]]:
    servers: list[EtcdServer] = []

    def make() -> EtcdServer:
        server = EtcdServer(tmp_path / f"etcd-{len(servers)}")
        servers.append(server)
        return server.start()

    try:
        yield make
    finally:
        for s in servers:
            s.stop()


@pytest.fixture
def unique_prefix() -> str:
    """A key prefix no other test uses, e.g. ``/t-1a2b3c4d``."""
    return f"/t-{uuid.uuid4().hex[:8]}"


def require_native(available: bool, what: str, why: str | None = None) -> None:
    """Skip a test of a native kernel only where no C compiler exists; where one does, a
    kernel that did not build is a failure (a broken build must not hide behind a skip)."""
    if available:
        return
    import shutil

    if os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"):
        pytest.fail(f"{what} did not build although a C compiler is installed: {why}")
    pytest.skip(f"no C compiler: {what} cannot be built")
