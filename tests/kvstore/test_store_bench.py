"""``python -m benchmarks.store.store_bench`` as a user runs it (from the repository root): a tiny
run, and --peer mooncake's clear failure."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = ["-m", "benchmarks.store.store_bench"]

pytestmark = pytest.mark.integration


def test_one_json_line_with_ratios_and_a_plot(tmp_path):
    r = subprocess.run([sys.executable, *BENCH, "--quick", "--iters", "1", "--lat-iters", "20",
                        "--memory", "256M",
                        "--max-batch-bytes", str(4 << 20), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr[-2000:]
    (line,) = r.stdout.strip().splitlines()
    result = json.loads(line)
    assert len(result["results"]) == 12 and (tmp_path / "store_bench.png").stat().st_size > 0
    for row in result["results"]:
        assert row["batch"] * row["block_bytes"] <= max(4 << 20, row["block_bytes"])
        for key in ("memcpy_gbps", "raw_socket_gbps", "shm_get_gbps", "tcp_get_gbps"):
            assert row[key] > 0
        if row["batch"] == 1:  # batch-1 latency columns
            assert 0 < row["shm_get_p50_us"] <= row["shm_get_p99_us"]
            assert 0 < row["tcp_get_p50_us"] <= row["tcp_get_p99_us"]
    assert set(result["targets_met"]) == {"shm_get_ge_60pct_memcpy", "tcp_get_ge_60pct_raw_socket",
                                          "shm_4k_get_p50_le_30us_p99_le_100us"}


def test_peer_mooncake_without_its_environment_says_what_to_do(tmp_path):
    r = subprocess.run([sys.executable, *BENCH, "--quick", "--peer", "mooncake",
                        "--mooncake-python", str(tmp_path / "missing" / "python"),
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode != 0 and r.stdout == ""
    assert "setup_mooncake.sh" in r.stderr and "--mooncake-python" in r.stderr


def test_tls_goes_with_hosts_and_ucx_without_tls(tmp_path):
    r = subprocess.run([sys.executable, *BENCH, "--transport", "ucx", "--tls", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode != 0 and r.stdout == "" and "--hosts 2" in r.stderr


def test_a_ucx_row_has_ratios_to_tcp_and_cpu_per_gb():
    from benchmarks.store.store_hosts import _row

    t = {"get": [0.5, 0.25], "raw_get": [0.2, 0.2], "tcp_get": [0.5, 0.5],
         "put": [1.0, 1.0], "raw_put": [0.5, 0.5], "tcp_put": [0.5, 0.5]}
    cpu = {"spent": {"get": 0.1, "tcp_get": 0.4}}
    row = _row(1 << 20, 1000, t, cpu)  # 1.048576 GB a call, two calls each
    assert row["get_vs_raw"] == 0.8 and row["get_vs_tcp"] == 2.0 and row["put_vs_tcp"] == 0.5
    # Three significant digits below 1 (``_round``): 0.0477, not 0.048.
    assert row["get_cpu_s_per_gb"] == 0.0477 == float(f"{0.1 / (2 * 1.048576):.3g}")
    assert row["tcp_get_cpu_s_per_gb"] == 0.191 and row["raw_get_cpu_s_per_gb"] == 0


def test_a_case_times_a_ucx_client_beside_tcp(ucx_daemon):
    """One tiny case of the single-host run with --transport ucx's client (not a measurement)."""
    import numpy as np

    from benchmarks.store.store_bench import RawSocket, run_case
    from kvstore import Client

    raw = RawSocket(64 << 10)
    try:
        with Client(ucx_daemon.address) as shm, Client(ucx_daemon.address, transport="tcp") as tcp, \
                Client(ucx_daemon.address, transport="ucx") as ucx:
            row = run_case(4096, 4, 1, np.random.default_rng(0), shm, tcp, raw, None, 0, 0, ucx)
    finally:
        raw.close()
    assert row["ucx_get_gbps"] > 0 and row["ucx_put_gbps"] > 0
    assert row["ucx_get_vs_tcp"] > 0 and row["ucx_get_vs_raw_socket"] > 0 and row["ucx_put_vs_tcp"] > 0


def test_the_hosts_client_with_ucx_reports_tcp_ratios_and_cpu(ucx_daemon, free_port):
    """store_bench --hosts 2 --transport ucx's client role, run here on one host against a
    UCX daemon and a raw server (one tiny case, not a measurement)."""
    from benchmarks.store import store_hosts

    port = free_port()
    raw = subprocess.Popen([sys.executable, "-c", store_hosts._ROLE, "raw-server", str(port),
                            str(64 << 10)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert raw.stdout is not None and raw.stdout.readline().strip() == "listening"
        got = store_hosts._client({
            "store": ucx_daemon.address, "raw": f"127.0.0.1:{port}", "raw_tls": "", "cases": [[4096, 2]],
            "iters": 1, "seed": 0, "handoff": False, "tls": False, "transport": "ucx",
            "pids": {"store": ucx_daemon.proc.pid, "raw": raw.pid}})
    finally:
        raw.wait(10)
    (row,) = got["results"]
    assert got["transport"] == "ucx" and row["get_vs_tcp"] > 0 and row["put_vs_tcp"] > 0
    assert all(row[f"{n}_cpu_s_per_gb"] >= 0 for n in ("get", "tcp_get", "raw_get", "put"))
