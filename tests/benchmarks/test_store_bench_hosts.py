"""``python -m benchmarks.store.store_bench --hosts 2`` at a tiny size: the daemon on one host of the
harness, the client on the other, over the veth link; one JSON line with a get and a put
ratio per case and the handoff. Skips only where namespaces cannot be made (fails under
CI=true, like the hosts fixture)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration


def test_hosts_2_one_json_line_with_ratios_over_the_link(hosts, tmp_path):
    hosts(1).close()  # the fixture's check: skip (or fail under CI=true) without namespaces
    r = subprocess.run([sys.executable, "-m", "benchmarks.store.store_bench", "--hosts", "2",
                        "--quick", "--iters", "1", "--memory", "192M",
                        "--max-batch-bytes", str(2 << 20), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    (line,) = r.stdout.strip().splitlines()
    res = json.loads(line)
    assert res["bench"] == "store_hosts" and res["hosts"] == 2 and res["tls"] is False
    link = res["link"]
    assert link["store_host"] != link["client_host"] and link["store_host"].startswith("10.77.")
    # 5 sizes (4 KiB to 16 MiB) x batches 1 and 64 (or what fits the 2 MiB cap); 16 MiB
    # blocks go one at a time under the cap, so its batches 1 and 64 are one case
    assert len(res["results"]) == 11 and len(res["ratios"]) == 11
    for row in res["results"]:
        assert row["batch"] * row["block_bytes"] <= max(2 << 20, row["block_bytes"])
        for key in ("get_gbps", "put_gbps", "raw_get_gbps", "raw_put_gbps", "get_vs_raw",
                    "put_vs_raw"):
            assert row[key] > 0, (key, row)
    assert set(res["ratios"]["360 KiB x 5"]) == {"get", "put"}
    h = res["handoff"]
    assert (h["tokens"], h["blocks"], h["block_bytes"]) == (2032, 127, 16 * 46_080 + 64)
    assert h["transfer_ms"] > 0 and h["raw_transfer_ms"] > 0 and h["transfer_vs_raw"] > 0
    assert set(res["targets_met"]) == {"get_ge_80pct_raw_socket"}


def test_tls_and_no_handoff_need_hosts(tmp_path):
    r = subprocess.run([sys.executable, "-m", "benchmarks.store.store_bench", "--tls",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=60,
                       cwd=REPO)
    assert r.returncode != 0 and r.stdout == "" and "--hosts 2" in r.stderr


def test_hosts_2_tls_against_a_plain_and_a_tls_raw_socket(hosts, tmp_path):
    hosts(1).close()
    r = subprocess.run([sys.executable, "-m", "benchmarks.store.store_bench", "--hosts", "2", "--tls",
                        "--no-handoff", "--quick", "--iters", "1", "--memory", "64M",
                        "--max-batch-bytes", str(1 << 20), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout)
    assert res["tls"] is True and res["link"]["tls"] is True and res["handoff"] is None
    for row in res["results"]:
        for key in ("get_vs_raw", "get_vs_raw_tls", "put_vs_raw_tls", "raw_tls_get_gbps"):
            assert row[key] > 0, (key, row)


def test_hosts_2_ucx_against_our_tcp_a_raw_socket_and_nixl(hosts, tmp_path):
    """``--transport ucx``: the timed client moves blocks over UCX, a TCP client and the raw
    socket beside it, and NIXL's one-sided READs and WRITEs of the same bytes between the same
    hosts (set-up installs nixl-cu12), each with its server's CPU-seconds per GB."""
    from benchmarks.peers import nixl_peer
    from kvstore.net import ucx

    if ucx.available() is not None or nixl_peer.available() is not None:
        pytest.skip(f"needs ucxx and nixl-cu12: {ucx.available() or nixl_peer.available()}")
    hosts(1).close()
    r = subprocess.run([sys.executable, "-m", "benchmarks.store.store_bench", "--hosts", "2",
                        "--transport", "ucx", "--no-handoff", "--quick", "--iters", "1",
                        "--memory", "64M", "--max-batch-bytes", str(1 << 20), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["transport"] == "ucx"
    for row in res["results"]:
        for key in ("get_gbps", "tcp_get_gbps", "raw_get_gbps", "nixl_get_gbps", "nixl_put_gbps",
                    "get_vs_tcp", "get_vs_nixl", "put_vs_nixl"):
            assert row[key] > 0, (key, row)
        assert row["get_cpu_s_per_gb"] >= 0 and row["nixl_get_cpu_s_per_gb"] >= 0
    assert {"get_vs_nixl", "put_vs_nixl"} <= set(res["ratios"]["360 KiB x 2"])
