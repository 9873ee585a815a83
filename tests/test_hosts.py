"""The hosts harness (router/cluster/hosts.py) with real processes: separate hostnames and
/dev/shm per host, one shared by a host's processes, TCP between hosts and from the root
namespace, a store daemon used over TCP from another host and over shared memory from its
own, and a teardown that leaves nothing behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from kvstore.proc import read_line
from tests.procs import REPO, running

SERVER = ("import socket, sys\n"
          "s = socket.create_server(('0.0.0.0', 7000))\n"
          "print('listening', flush=True)\n"
          "while True:\n"
          "    c, peer = s.accept()\n"
          "    c.sendall(('hello ' + peer[0]).encode()); c.close()\n")
DIAL = ("import socket, sys\n"
        "with socket.create_connection((sys.argv[1], 7000), timeout=5) as c:\n"
        "    print(c.recv(100).decode())\n")
CLIENT = ("import sys\n"
          "from kvstore import BlockKey, Client\n"
          "key = BlockKey(sys.argv[3].encode() * 16)\n"
          "with Client(sys.argv[1], auth_token=sys.argv[2], timeout=5) as c:\n"
          "    c.put([key], [sys.argv[3].encode() * 4096])\n"
          "    assert c.get_bytes([key]) == [sys.argv[3].encode() * 4096]\n"
          "    print(c.transport, c.map_attempts)\n")
_SECRET_ENV = ("KVSTORE_AUTH_TOKEN", "KVCACHE_CLUSTER_SECRET", "KVCACHE_CLUSTER_SECRET_FILE")


def _ok(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_each_host_has_its_own_hostname_and_dev_shm(hosts):
    a, b = hosts(2)
    assert _ok(a.run(["hostname"])) == a.name != _ok(b.run(["hostname"])) == b.name
    _ok(a.run(["sh", "-c", "echo x > /dev/shm/kvh-test"]))
    assert _ok(a.run(["cat", "/dev/shm/kvh-test"])) == "x"  # a second process on host A
    assert b.run(["cat", "/dev/shm/kvh-test"]).returncode != 0
    assert not os.path.exists("/dev/shm/kvh-test")  # nor in the root namespace


def test_tcp_between_hosts_and_from_the_root_namespace(hosts):
    import socket

    h = hosts(2)
    a, b = h
    server = a.popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    assert read_line(server, "the server", 20) == "listening"
    assert _ok(b.run([sys.executable, "-c", DIAL, a.address])) == f"hello {b.address}"
    with socket.create_connection((a.address, 7000), timeout=5) as c:
        assert c.recv(100).decode() == f"hello {h.bridge_address}"
    # A name lookup inside a host resolves the harness's names and never leaves it.
    assert _ok(b.run([sys.executable, "-c", "import socket; print(socket.gethostbyname("
                      f"{a.name!r}))"])) == a.address


def test_teardown_leaves_no_namespace_link_or_process(hosts):
    h = hosts(2)
    a = h[0]
    sleeper = a.popen(["sh", "-c", "sleep 60 & sleep 60"])  # a child in its process group
    escaped = a.popen(["setsid", "sleep", "60"])  # and one that left it
    names, links = [x.name for x in h], [h.bridge] + [x.veth for x in h]
    time.sleep(0.1)
    pids = [int(p) for p in subprocess.run(["ip", "netns", "pids", a.name], capture_output=True,
                                           text=True).stdout.split()]
    assert len(pids) >= 4  # the host's init, both sleeps, the setsid sleep
    t0 = time.monotonic()
    h.close()
    assert time.monotonic() - t0 < 5
    assert sleeper.poll() is not None and escaped.poll() is not None
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    link = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    assert not [n for n in names if n in netns]
    assert not [x for x in links if f" {x}:" in link or f" {x}@" in link]
    assert not os.path.exists(f"/etc/netns/{a.name}")
    for pid in pids:
        assert not running(pid), pid


def test_a_store_daemon_serves_another_host_over_tcp_and_its_own_over_shm(hosts, tmp_path):
    a, b = hosts(2)
    secret = "s3cret-for-the-hosts-test"
    (tmp_path / "secret").write_text(secret)
    env = {k: v for k, v in os.environ.items() if k not in _SECRET_ENV}
    daemon = a.popen([sys.executable, "-m", "kvstore.daemon.cli", "serve", "--host", "0.0.0.0",
                      "--port", "7700", "--memory", "16M",
                      "--cluster-secret-file", str(tmp_path / "secret")],
                     env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready = read_line(daemon, "the store daemon", 20)
    # Bound to a wildcard, it reports the address other hosts reach it at.
    assert ready.startswith(f"kvstore ready address={a.address}:7700 "), ready
    address = f"{a.address}:7700"
    # Across hosts no mapping is even attempted (a failed one silently falling back to TCP
    # would not pass); on the daemon's own host the one attempt maps the arena.
    assert _ok(b.run([sys.executable, "-c", CLIENT, address, secret, "b"], env=env)) == "tcp 0"
    assert _ok(a.run([sys.executable, "-c", CLIENT, address, secret, "a"], env=env)) == "shm 1"


def test_a_killed_harness_leaves_no_process_and_the_next_one_sweeps_its_namespaces(hosts):
    script = ("import sys, time\n"
              "from router.cluster.hosts import Hosts\n"
              "h = Hosts(1).start()\n"
              "p = h[0].popen(['sleep', '60'])\n"
              "print(h[0].name, h.bridge, h[0]._init.pid, p.pid, flush=True)\n"
              "time.sleep(60)\n")
    owner = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    name, bridge, *pids = read_line(owner, "the harness", 20).split()
    owner.kill()
    owner.wait()
    deadline = time.monotonic() + 5
    while any(running(p) for p in pids):
        assert time.monotonic() < deadline, "the host's processes outlived their harness"
        time.sleep(0.02)
    assert name in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    new = hosts(1)
    assert name not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    link = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    # Its bridge is gone, or its name was free again for the new harness's (`ip link add`
    # fails on a name that exists).
    assert new.bridge == bridge or f" {bridge}:" not in link
