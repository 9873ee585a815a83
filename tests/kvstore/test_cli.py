"""`kvstore stats`, `kvstore bench` and `kvstore serve`'s argument handling, as a user runs them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration


def kvstore(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstore.daemon.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def test_stats_human_and_json(shared_daemon):
    r = kvstore("stats", shared_daemon.address, "--json")
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout)
    assert stats["server"]["node_id"] == shared_daemon.node_id
    assert stats["store"]["host"]["capacity_bytes"] == 64 << 20
    r = kvstore("stats", shared_daemon.address)
    assert r.returncode == 0, r.stderr
    assert shared_daemon.node_id in r.stdout and "host" in r.stdout and "64.0MiB" in r.stdout


def test_bench_reports_throughput(shared_daemon):
    for transport in ("auto", "tcp"):
        r = kvstore("bench", shared_daemon.address, "--size", "64K", "--batch", "4",
                    "--iters", "2", "--transport", transport, "--json")
        assert r.returncode == 0, r.stderr
        result = json.loads(r.stdout)
        assert result["transport"] == ("shm" if transport == "auto" else "tcp")
        assert result["get_gbps"] > 0 and result["put_gbps"] > 0


def test_unreachable_daemon_is_a_clear_error():
    r = kvstore("stats", "127.0.0.1:1", "--timeout", "1")
    assert r.returncode == 1 and "StoreUnavailable" in r.stderr and "kvstore serve" in r.stderr


def test_serve_rejects_bad_sizes():
    r = kvstore("serve", "--port", "0", "--memory", "lots")
    assert r.returncode == 2 and "512M" in r.stderr


def test_serve_rejects_a_bad_registration_ttl():
    r = kvstore("serve", "--port", "0", "--memory", "8M", "--registration-ttl", "0")
    assert r.returncode == 2 and "--registration-ttl must be positive" in r.stderr


def test_serve_on_a_port_in_use_says_so_in_one_line():
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        r = kvstore("serve", "--port", str(port), "--memory", "8M")
    assert r.returncode != 0
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert f"127.0.0.1:{port}" in r.stderr and "in use" in r.stderr


def test_serve_beyond_loopback_needs_a_secret_or_insecure():
    r = kvstore("serve", "--host", "0.0.0.0", "--port", "0", "--memory", "8M")
    assert r.returncode == 2 and "without a cluster secret" in r.stderr and "--insecure" in r.stderr


def test_stats_takes_the_cluster_secret(start_daemon, tmp_path):
    path = tmp_path / "secret"
    path.write_text("s3cret\n")
    d = start_daemon("--cluster-secret-file", str(path))
    r = kvstore("stats", d.address, "--json", "--cluster-secret-file", str(path))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["server"]["node_id"] == d.node_id
