"""``kvengine serve --advertise-address`` (and its old name ``--advertise-host``): the address
in the worker's WorkerInfo and etcd registration (kvstore/net/address.py decides the default)."""

from __future__ import annotations

from engine.worker import cli


def _advertise(*argv: str) -> str | None:
    return cli.config_from_args(cli.build_parser().parse_args(["serve", *argv])).advertise_host


def test_advertise_address_and_its_old_name():
    assert _advertise("--advertise-address", "10.1.2.3") == "10.1.2.3"
    assert _advertise("--advertise-host", "10.1.2.4") == "10.1.2.4"
    assert _advertise() is None


def test_a_worker_on_a_wildcard_advertises_its_hosts_address(hosts, tiny_llama_dir):
    """In a host of its own, bound to 0.0.0.0 without the flag: the host's address."""
    import select
    import subprocess
    import sys

    from tests.engine.worker_procs import worker_env
    from tests.procs import REPO

    (a,) = hosts(1)
    proc = a.popen([sys.executable, "-m", "engine.worker.cli", "serve", "--model", str(tiny_llama_dir),
                    "--host", "0.0.0.0", "--port", "8100", "--insecure", "--threads", "1"],
                   env=worker_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                   text=True)
    assert proc.stdout is not None and proc.stderr is not None
    line = proc.stdout.readline() if select.select([proc.stdout], [], [], 90)[0] else ""
    assert line.startswith(f"kvengine ready address=http://{a.address}:8100 "), (
        line or proc.stderr.read())
