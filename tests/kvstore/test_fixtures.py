"""The daemon fixtures themselves: no daemon survives the pytest process that started it."""

import signal
import subprocess
import sys
import time

import pytest

from tests.daemons import SHM_DIR
from tests.procs import REPO, running

pytestmark = pytest.mark.integration

START_AND_HANG = """
import sys, time
from pathlib import Path
from tests.daemons import DaemonFactory
d = DaemonFactory(Path(sys.argv[1]))()
print(d.proc.pid, d.arena, flush=True)
time.sleep(120)
"""


def test_a_daemon_dies_with_the_pytest_that_started_it(tmp_path):
    runner = subprocess.Popen([sys.executable, "-c", START_AND_HANG, str(tmp_path)], cwd=REPO,
                              stdout=subprocess.PIPE, text=True)
    try:
        pid, arena = runner.stdout.readline().split()
        runner.send_signal(signal.SIGKILL)  # no teardown runs: only PR_SET_PDEATHSIG is left
        runner.wait()
        deadline = time.monotonic() + 10
        while running(pid):
            assert time.monotonic() < deadline, f"daemon {pid} outlived its parent"
            time.sleep(0.05)
    finally:
        runner.kill()
        runner.wait()
    (SHM_DIR / arena).unlink(missing_ok=True)  # SIGKILLed: its arena is ours to remove


def test_etcd_fixture_moves_to_new_ports_when_one_was_taken_before_it_bound(tmp_path):
    import socket

    from tests.etcd import EtcdServer

    server = EtcdServer(tmp_path / "etcd")
    with socket.socket() as squatter:          # what an outgoing connection's port does
        squatter.bind(("127.0.0.1", server.client_port))
        squatter.listen()
        taken = server.client_port
        server.start()
        try:
            assert server.client_port != taken and server.url.endswith(f":{server.client_port}")
        finally:
            server.stop()
