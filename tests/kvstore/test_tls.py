"""TLS with mutual certificates on the store's TCP protocol and on etcd (kvstore.tls): real
daemons (``kvstore serve --tls-*``), real etcd, certificates made by ``kvstore.certs``.

A client needs a certificate of the daemon's CA *and* the cluster secret; one without a
certificate, with one of another CA, or speaking plain TCP is refused, and the daemon goes
on serving everyone else, also while a peer sits in the middle of its handshake.
"""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvstore.certs import make_certs
from kvstore.client.node import Client
from kvstore.errors import AuthError, EtcdError, StoreUnavailable
from kvstore.proc import free_port
from kvstore.tls import TLSConfig, TLSError, resolve

SECRET = "tls-test-secret"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TLSConfig]:
    return make_certs(tmp_path_factory.mktemp("certs"), names=["daemon", "client"])


@pytest.fixture(scope="module")
def foreign(tmp_path_factory: pytest.TempPathFactory) -> TLSConfig:
    """A certificate of another CA."""
    return make_certs(tmp_path_factory.mktemp("other-ca"), names=["intruder"])["intruder"]


@pytest.fixture
def tls_daemon(start_daemon, certs):
    return start_daemon(*certs["daemon"].args(), "--cluster-secret", SECRET)


def _values(n: int, size: int, seed: int) -> tuple[list[bytes], list[bytes]]:
    rng = np.random.default_rng(seed)
    return ([rng.bytes(16) for _ in range(n)], [rng.bytes(size) for _ in range(n)])


def test_put_get_over_tls_with_mutual_certificates(tls_daemon, certs) -> None:
    keys, values = _values(24, 300_000, 1)   # 7 MB: many TLS records per frame
    with Client(tls_daemon.address, tls=certs["client"], auth_token=SECRET, transport="tcp") as c:
        assert c.transport == "tcp"
        c.put(keys, values)
        bufs = [np.empty(300_000, np.uint8) for _ in keys]
        assert c.get(keys, bufs) == [True] * len(keys)
        assert [b.tobytes() for b in bufs] == values
        assert c.contains(keys[:3] + [b"\0" * 16]) == [True, True, True, False]
    # On the daemon's host the values go through shared memory; the control frames stay TLS.
    with Client(tls_daemon.address, tls=certs["client"], auth_token=SECRET) as c:
        assert c.transport == "shm"
        assert c.get_bytes(keys[:4]) == values[:4]
    # The command-line client takes the same flags.
    out = subprocess.run([sys.executable, "-m", "kvstore.daemon.cli", "stats", tls_daemon.address,
                          "--json", *certs["client"].args(), "--cluster-secret", SECRET],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert '"node_id"' in out.stdout


def test_refused_peers_and_the_daemon_serves_on(tls_daemon, certs, foreign) -> None:
    good = certs["client"]
    # A peer that opens a connection and never finishes its handshake holds no thread.
    stalled = socket.create_connection(("127.0.0.1", int(tls_daemon.address.rsplit(":", 1)[1])))
    try:
        with pytest.raises(StoreUnavailable, match="require TLS"):
            Client(tls_daemon.address, tls=False, auth_token=SECRET, timeout=3).stats()
        # A certificate of another CA (the daemon's CA trusted): the daemon refuses it (with
        # TLS 1.3 after the client's side of the handshake: its alert is an AuthError, or,
        # should a reset overtake the alert, an end of stream).
        with pytest.raises((AuthError, StoreUnavailable)):
            Client(tls_daemon.address, tls=TLSConfig(foreign.cert, foreign.key, good.ca),
                   auth_token=SECRET, timeout=3).stats()
        # This side does not trust the daemon (another CA): the client refuses it.
        with pytest.raises(AuthError, match="certificate"):
            Client(tls_daemon.address, tls=foreign, auth_token=SECRET, timeout=3).stats()
        # No client certificate at all.
        ctx = ssl.create_default_context(cafile=good.ca)
        with pytest.raises((ssl.SSLError, ConnectionError)):
            with ctx.wrap_socket(socket.create_connection(("127.0.0.1", int(tls_daemon.address.rsplit(":", 1)[1])),
                                                          timeout=3), server_hostname="127.0.0.1") as s:
                s.sendall(b"KVSP" + bytes(28))
                assert s.recv(1) == b""   # TLS 1.3: the refusal comes after the client's finish
                raise ConnectionError("closed")
        # The right certificate but the wrong secret: the secret is still checked.
        with pytest.raises(AuthError, match="auth token"):
            Client(tls_daemon.address, tls=good, auth_token="wrong", timeout=3).stats()
        # ... and the daemon goes on serving, the stalled handshake still open.
        keys, values = _values(4, 1000, 2)
        with Client(tls_daemon.address, tls=good, auth_token=SECRET, transport="tcp") as c:
            c.put(keys, values)
            assert c.get_bytes(keys) == values
            assert c.stats()["server"]["connections"] >= 2   # this one and the stalled one
    finally:
        stalled.close()
    assert tls_daemon.proc.poll() is None


@pytest.mark.usefixtures("procs")  # starts processes: the integration tier
def test_settings_errors_are_one_clear_line(tmp_path: Path, certs) -> None:
    a, b = certs["daemon"], certs["client"]
    with pytest.raises(TLSError, match="go together; missing --tls-key"):
        resolve(cert=a.cert, environ={})
    with pytest.raises(TLSError, match="cannot read the TLS certificate"):
        resolve(str(tmp_path / "nope.pem"), a.key, a.ca, environ={})
    with pytest.raises(TLSError, match="is not the key of the certificate"):
        resolve(a.cert, b.key, a.ca, environ={})
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    with pytest.raises(TLSError, match="not a PEM file"):
        resolve(a.cert, a.key, str(tmp_path / "junk.pem"), environ={})
    env = {"KVCACHE_TLS_CERT": a.cert, "KVCACHE_TLS_KEY": a.key, "KVCACHE_TLS_CA": a.ca}
    assert resolve(environ=env) == a
    assert resolve(environ={}) is None
    out = subprocess.run([sys.executable, "-m", "kvstore.daemon.cli", "serve", "--port", "0",
                          "--tls-cert", a.cert, "--tls-key", b.key, "--tls-ca", a.ca],
                         capture_output=True, text=True, timeout=30,
                         env={k: v for k, v in os.environ.items() if not k.startswith("KVCACHE_TLS")})
    assert out.returncode == 2
    assert "is not the key of the certificate" in out.stderr


@pytest.mark.usefixtures("procs")  # starts processes: the integration tier
def test_etcd_over_tls_with_client_certificates(tmp_path: Path, certs, foreign) -> None:
    from kvstore.coord.etcd import EtcdClient

    node = certs["daemon"]
    client_url, peer_url = f"https://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        ["etcd", "--name", "t", "--data-dir", str(tmp_path / "etcd"),
         "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
         "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
         "--initial-cluster", f"t={peer_url}", "--cert-file", node.cert, "--key-file", node.key,
         "--trusted-ca-file", node.ca, "--client-cert-auth", "--log-level", "warn", "--logger", "zap"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "etcd.log", "wb"))
    try:
        with EtcdClient(client_url, tls=certs["client"]) as etcd:
            deadline = time.monotonic() + 20
            while True:
                try:
                    etcd.ping()
                    break
                except EtcdError:
                    assert proc.poll() is None and time.monotonic() < deadline, \
                        (tmp_path / "etcd.log").read_text()[-2000:]
                    time.sleep(0.1)
            rev = etcd.put("/tls/a", b"1")
            assert etcd.get("/tls/a") == b"1"
            watch = etcd.watch_prefix("/tls/", rev + 1, probe_interval=0.5)
            etcd.put("/tls/b", b"2")
            event = next(iter(watch))
            assert (event.key, event.value) == ("/tls/b", b"2")
            watch.close()
        # No scheme: https, since TLS is configured.
        with EtcdClient(client_url.removeprefix("https://"), tls=certs["client"]) as etcd:
            assert etcd.get("/tls/a") == b"1"
        for wrong in (TLSConfig(foreign.cert, foreign.key, node.ca), foreign):
            with EtcdClient(client_url, tls=wrong, timeout=1.0) as etcd:
                with pytest.raises(EtcdError):
                    etcd.get("/tls/a")
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.usefixtures("procs")  # starts processes: the integration tier
def test_certs_make_command(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "kvstore.daemon.cli", "certs", "make", str(tmp_path),
                          "--name", "store", "--ip", "10.77.0.11"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    store = TLSConfig.from_dir(tmp_path, "store")
    assert " ".join(store.args()) in out.stdout
    assert oct(os.stat(store.key).st_mode & 0o777) == "0o600"
    decoded = ssl._ssl._test_decode_cert(store.cert)  # type: ignore[attr-defined]
    assert {("IP Address", "10.77.0.11"), ("IP Address", "127.0.0.1"),
            ("DNS", "localhost")} <= set(decoded["subjectAltName"])
