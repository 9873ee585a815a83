"""``python -m benchmarks.store_bench`` as a user runs it (from the repository root): a tiny run, and --peer mooncake's clear failure."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = ["-m", "benchmarks.store_bench"]

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
    from benchmarks.store_hosts import _row

    t = {"get": [0.5, 0.25], "raw_get": [0.2, 0.2], "tcp_get": [0.5, 0.5],
         "put": [1.0, 1.0], "raw_put": [0.5, 0.5], "tcp_put": [0.5, 0.5]}
    cpu = {"spent": {"get": 0.1, "tcp_get": 0.4}}
    row = _row(1 << 20, 1000, t, cpu)  # 1.048576 GB a call, two calls each
    assert row["get_vs_raw"] == 0.8 and row["get_vs_tcp"] == 2.0 and row["put_vs_tcp"] == 0.5
    assert row["get_cpu_s_per_gb"] == round(0.1 / (2 * 1.048576), 3)
    assert row["tcp_get_cpu_s_per_gb"] == round(0.4 / (2 * 1.048576), 3) and row["raw_get_cpu_s_per_gb"] == 0
