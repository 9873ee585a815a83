"""UCX between two hosts (network namespaces, router/cluster/hosts.py): a client on host B
picks UCX for a daemon on host A that serves it, and moves a batch both ways over it."""

import json
import re
import subprocess
import sys

import pytest

from kvstore.net import ucx

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(ucx.available() is not None, reason=str(ucx.available()))]

CLIENT = """
import json, os, sys
import numpy as np
from kvstore import Client
with Client(sys.argv[1], timeout=10) as c:
    keys = [os.urandom(16) for _ in range(16)]
    vals = [np.random.default_rng(i).integers(0, 256, 360 << 10, dtype=np.uint8) for i in range(16)]
    held = c.put(keys, vals)
    bufs = [np.zeros(360 << 10, np.uint8) for _ in keys]
    found = c.get(keys, bufs)
    print(json.dumps({"transport": c.transport, "held": all(held), "found": all(found),
                      "equal": all(np.array_equal(a, b) for a, b in zip(bufs, vals)),
                      "map_attempts": c.map_attempts,
                      "socket_bytes": c.bytes_sent + c.bytes_received}))
"""


def test_a_client_on_another_host_picks_ucx_and_moves_blocks(hosts, tmp_path):
    a, b = hosts(2)
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    daemon = a.popen([sys.executable, "-m", "kvstore.daemon.cli", "serve", "--host", "0.0.0.0",
                      "--port", "7700", "--memory", "64M", "--ucx", "--cluster-secret-file",
                      str(secret), "--log-level", "WARNING"], stdout=subprocess.PIPE, text=True)
    assert daemon.stdout is not None
    line = daemon.stdout.readline()
    assert re.search(r"kvstore ready address=\S+", line), line
    env = {"KVCACHE_CLUSTER_SECRET_FILE": str(secret), "PATH": "/usr/bin:/bin",
           "PYTHONPATH": ".", "UCX_WARN_UNUSED_ENV_VARS": "n"}
    r = b.run([sys.executable, "-c", CLIENT, f"{a.address}:7700"], timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["transport"] == "ucx" and got["held"] and got["found"] and got["equal"]
    assert got["map_attempts"] == 0  # another host: no arena to map
    assert got["socket_bytes"] < 64 << 10  # 11.5 MiB moved, only keys and sizes on the socket
