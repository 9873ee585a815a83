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
- ``etcd_server``: a factory of private etcd servers (``EtcdServer``, tests/etcd.py) that a
  test may stop and restart; each is stopped at the end of the test.
- ``hosts``: a factory of N hosts in network namespaces (``hosts(n)``, tests/hosts_fixture.py).

Helpers are modules, imported by the tests that use them: ``EtcdServer`` (tests/etcd.py, with
its short heartbeat and election timeout, so a 1 s lease TTL stays 1 s), ``require_native``
(tests/native.py), the process tools of tests/procs.py and tests/daemons.py. Nothing imports
from a conftest.py.
"""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvstore.proc import free_port as _free_port
from tests.etcd import EtcdServer

pytest_plugins = ["tests.procs", "tests.daemons", "tests.hosts_fixture"]

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

