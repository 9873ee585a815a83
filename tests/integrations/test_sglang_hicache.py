"""The kvstore HiCache backend inside real SGLang, against real ``kvstore serve`` daemons.

SGLang cannot share the project's environment (it pins another torch), so the SGLang side runs
in ``.venv-sglang`` (``bash scripts/setup_sglang.sh``) as a subprocess, ``sglang_driver.py``:
it loads the backend through SGLang's own ``StorageBackendFactory`` "dynamic" path, the way
``--hicache-storage-backend dynamic`` does, and calls it as SGLang's cache controller does,
into and out of host KV pool memory (the driver's docstring says why the pools are its own).
These tests start the daemons, talk to the driver over its stdin/stdout, and check:

- set then get round-trips bit for bit into host-pool memory (v1 zero-copy and generic calls);
  batch_exists counts the leading stored pages;
- a second process finds what the first stored (deterministic keys), over TCP where the first
  used shared memory; MHA pages are per TP rank, MLA pages are shared by every rank;
- a full store fails only the pages that did not fit;
- a killed daemon, or one that refuses the secret, gives misses and False, never an exception;
- a cluster through etcd serves the same calls.
"""

from __future__ import annotations

import hashlib
import json
import os
import select
import signal
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest

from kvstore import Client
from kvstore.client.cluster import ClusterClient
from kvstore.net import protocol as P
from kvstore.proc import die_with_parent
from tests.daemons import DaemonFactory, DaemonProc
from tests.procs import REPO

pytestmark = pytest.mark.integration

SGLANG_PY = REPO / ".venv-sglang" / "bin" / "python"
DRIVER = Path(__file__).with_name("sglang_driver.py")
SECRET = "sglang-hicache-test-secret"
# SGLang's part of --hicache-storage-backend-extra-config (docs/integrations.md copies it).
BACKEND = {"backend_name": "kvstore", "module_path": "kvstore.integrations.sglang_hicache",
           "class_name": "KVStoreHiCache", "interface_v1": 1}
_SECRET_ENV = ("KVCACHE_CLUSTER_SECRET", "KVCACHE_CLUSTER_SECRET_FILE", "KVSTORE_AUTH_TOKEN")


def page_hashes(n: int) -> list[str]:
    """``n`` SGLang-like page keys (hex sha256 strings) that no other test uses."""
    tag = uuid.uuid4().hex
    return [hashlib.sha256(f"{tag}-{i}".encode()).hexdigest() for i in range(n)]


class Driver:
    """``sglang_driver.py`` in the SGLang environment; ``driver(op, **args)`` -> its answer.
    An exception inside the backend (or the driver) fails the test with its text."""

    def __init__(self, log: Path) -> None:
        env = {k: v for k, v in os.environ.items() if k not in _SECRET_ENV}
        self.log = log
        with open(log, "wb") as err:
            self.proc = subprocess.Popen(
                [str(SGLANG_PY), str(DRIVER)], cwd=REPO, env=env, text=True, stderr=err,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                preexec_fn=die_with_parent(signal.SIGKILL))
        self.ready = self._read(timeout=90)  # SGLang's import: a few seconds here
        self.seconds = 0.0  # how long the last call took inside the driver

    def __call__(self, op: str, timeout: float = 30, **args: Any) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        reply = self._read(timeout)
        assert "error" not in reply, f"{op} raised inside SGLang: {reply['error']}"
        self.seconds = reply["s"]
        return reply["ok"]

    def _read(self, timeout: float) -> dict:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            raise AssertionError(f"the SGLang driver {'exited' if ready else 'hung'}:\n"
                                 + self.log.read_text(errors="replace")[-4000:])
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def sglang_env() -> Path:
    if not SGLANG_PY.exists():
        pytest.skip("the SGLang environment is not built: bash scripts/setup_sglang.sh")
    return SGLANG_PY


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sglang-hicache")


@pytest.fixture(scope="module")
def daemons(workdir: Path):
    factory = DaemonFactory(workdir / "daemons")
    try:
        yield factory
    finally:
        factory.close()


@pytest.fixture(scope="module")
def secret_file(workdir: Path) -> Path:
    path = workdir / "cluster-secret"
    path.write_text(SECRET + "\n")
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def store(daemons: DaemonFactory, secret_file: Path) -> DaemonProc:
    """The daemon most tests share: it requires the cluster secret."""
    return daemons("--cluster-secret-file", str(secret_file))


@pytest.fixture(scope="module")
def driver(sglang_env: Path, workdir: Path):
    d = Driver(workdir / "driver-a.log")
    try:
        yield d
    finally:
        d.close()


def test_the_factory_loads_the_backend_and_pages_round_trip_bit_for_bit(driver, store, secret_file):
    assert driver.ready["sglang"] and driver.ready["torch"].startswith("2.13.0")
    config = {**BACKEND, "store": store.address, "cluster_secret_file": str(secret_file)}
    info = driver("load", name="a", extra_config=config)
    assert info["class"] == "kvstore.integrations.sglang_hicache.KVStoreHiCache"
    assert info["is_hicache_storage"] and info["block_bytes"] == [16384, 16384]  # K, V
    assert info["transport"] == "shm"  # same host: puts and gets through the mapped arena
    keys = page_hashes(4)
    written = driver("fill", name="a", pages=[0, 1, 2, 3], seed=1)
    assert len(set(written)) == 4
    assert driver("exists", name="a", keys=keys) == 0
    assert driver("set_v1", name="a", keys=keys, pages=[0, 1, 2, 3]) == [True] * 4
    assert driver("set_v1", name="a", keys=keys[:2], pages=[0, 1]) == [True] * 2  # present
    assert driver("exists", name="a", keys=keys) == 4
    assert driver("exists", name="a", keys=keys[:2] + page_hashes(1) + keys[3:]) == 2
    assert driver("get_v1", name="a", keys=keys, pages=[4, 5, 6, 7]) == [True] * 4
    assert driver("digests", name="a", pages=[4, 5, 6, 7]) == written
    # A miss among hits: per page, and the missing page's memory is not the test's concern.
    assert driver("get_v1", name="a", keys=[keys[0], page_hashes(1)[0]],
                  pages=[8, 9]) == [True, False]
    assert driver("digests", name="a", pages=[8]) == written[:1]


def test_the_generic_calls_round_trip_and_keep_their_own_keys(driver, store, secret_file):
    generic = {k: v for k, v in BACKEND.items() if k != "interface_v1"}
    driver("load", name="g", extra_config={**generic, "store": store.address,
                                            "cluster_secret": SECRET})
    keys = page_hashes(3)
    written = driver("fill", name="g", pages=[0, 1, 2], seed=2)
    assert driver("set_generic", name="g", keys=keys, pages=[0, 1, 2]) is True
    assert driver("exists", name="g", keys=keys) == 3
    assert driver("get_generic", name="g", keys=keys, pages=[5, 6, 7]) == [True] * 3
    assert driver("digests", name="g", pages=[5, 6, 7]) == written
    assert driver("get_generic", name="g", keys=page_hashes(1), pages=[8]) == [False]
    # The v1 path stores a page as its K and V blocks, the generic one as one flat page:
    # neither reads the other's bytes.
    driver("load", name="v1", extra_config={**BACKEND, "store": store.address,
                                             "cluster_secret": SECRET})
    assert driver("exists", name="v1", keys=keys) == 0


def test_a_second_process_finds_what_the_first_stored(driver, store, secret_file, workdir):
    config = {**BACKEND, "store": store.address, "cluster_secret_file": str(secret_file)}
    keys = page_hashes(3)
    driver("load", name="w", extra_config=config, tp_rank=0, tp_size=2)
    written = driver("fill", name="w", pages=[0, 1, 2], seed=3)
    assert driver("set_v1", name="w", keys=keys, pages=[0, 1, 2]) == [True] * 3
    driver("load", name="mla0", extra_config=config, tp_rank=0, tp_size=2, mla=True)
    mla_written = driver("fill", name="mla0", pages=[0, 1], seed=4)
    assert driver("set_v1", name="mla0", keys=keys[:2], pages=[0, 1]) == [True] * 2

    second = Driver(workdir / "driver-b.log")
    try:
        tcp = {**BACKEND, "store": store.address, "cluster_secret": SECRET, "transport": "tcp"}
        assert second("load", name="r", extra_config=tcp, tp_rank=0, tp_size=2)["transport"] == "tcp"
        assert second("exists", name="r", keys=keys) == 3
        assert second("get_v1", name="r", keys=keys, pages=[10, 11, 12]) == [True] * 3
        assert second("digests", name="r", pages=[10, 11, 12]) == written
        # MHA: another TP rank holds other heads, so it has pages of its own ...
        second("load", name="r1", extra_config=tcp, tp_rank=1, tp_size=2)
        assert second("exists", name="r1", keys=keys) == 0
        # ... MLA: every rank holds the same latent cache, so rank 1 reads what rank 0 wrote.
        second("load", name="mla1", extra_config=tcp, tp_rank=1, tp_size=2, mla=True)
        assert second("get_v1", name="mla1", keys=keys[:2], pages=[3, 4]) == [True] * 2
        assert second("digests", name="mla1", pages=[3, 4]) == mla_written
        # Another model never sees these pages.
        second("load", name="other", extra_config=tcp, tp_rank=0, tp_size=2, model="other")
        assert second("exists", name="other", keys=keys) == 0
    finally:
        second.close()


def test_a_full_store_fails_only_the_pages_that_did_not_fit(driver, daemons, workdir):
    """Two pages are stored, then another connection reserves all but 8 KiB of the 16 MiB
    arena (the stored pages move to the SSD tier, still held): a batch of those two pages and
    two new ones answers True for the held pages and False for the two that cannot fit."""
    d = daemons("--ssd-path", str(workdir / "ssd"), "--ssd-capacity", "64M",
                "--max-conn-reserve", "100%", memory="16M")
    driver("load", name="f", extra_config={**BACKEND, "store": d.address})
    keys = page_hashes(4)
    written = driver("fill", name="f", pages=[0, 1, 2, 3], seed=5)
    assert driver("set_v1", name="f", keys=keys[:2], pages=[0, 1]) == [True, True]
    with Client(d.address) as holder:
        capacity = holder.stats()["store"]["host"]["capacity_bytes"]
        holder._connection().exchange(  # one reservation, never committed while held
            P.Op.RESERVE, P.pack_keys_sizes([os.urandom(16)], [capacity - (8 << 10)]), expect=8)
        assert driver("set_v1", name="f", keys=keys, pages=[0, 1, 2, 3]) == [True, True, False, False]
        assert driver("exists", name="f", keys=keys) == 2
    # The reservation went with its connection: the same batch now fits, bytes intact.
    assert driver("set_v1", name="f", keys=keys, pages=[0, 1, 2, 3]) == [True] * 4
    assert driver("get_v1", name="f", keys=keys, pages=[8, 9, 10, 11]) == [True] * 4
    assert driver("digests", name="f", pages=[8, 9, 10, 11]) == written


def test_a_dead_or_refusing_store_gives_misses_not_exceptions(driver, daemons, store):
    d = daemons(memory="16M")
    driver("load", name="k", extra_config={**BACKEND, "store": d.address, "retry_after": 0.2})
    keys = page_hashes(3)
    driver("fill", name="k", pages=[0, 1, 2], seed=6)
    assert driver("set_v1", name="k", keys=keys, pages=[0, 1, 2]) == [True] * 3
    d.kill()  # SIGKILL; waits, unlinks its arena
    for _ in range(2):  # the call that finds it dead, and one while it is left alone
        assert driver("exists", name="k", keys=keys) == 0
        assert driver("get_v1", name="k", keys=keys, pages=[4, 5, 6]) == [False] * 3
        assert driver("set_v1", name="k", keys=keys, pages=[0, 1, 2]) == [False] * 3
        assert driver.seconds < 2.0
    # A store that is down when the engine starts is no failed start, only misses.
    driver("load", name="k2", extra_config={**BACKEND, "store": d.address})
    assert driver("get_v1", name="k2", keys=keys, pages=[4, 5, 6]) == [False] * 3
    # A store that refuses the secret (AuthError) is a miss as well.
    driver("load", name="bad", extra_config={**BACKEND, "store": store.address,
                                              "cluster_secret": "not-the-secret"})
    assert driver("set_v1", name="bad", keys=keys, pages=[0, 1, 2]) == [False] * 3
    assert driver("exists", name="bad", keys=keys) == 0


def test_a_cluster_through_etcd(driver, daemons, etcd):
    """``etcd`` + ``cluster`` instead of ``store``: the pages spread over the registered nodes
    and come back bit for bit."""
    cluster = f"sgl{uuid.uuid4().hex[:8]}"
    nodes = [daemons("--etcd", etcd, "--cluster", cluster) for _ in range(2)]
    with ClusterClient(etcd, cluster) as cc:
        assert cc.wait_for_nodes(2, 10.0)
    driver("load", name="c", extra_config={**BACKEND, "etcd": etcd, "cluster": cluster})
    keys = page_hashes(8)
    written = driver("fill", name="c", pages=list(range(8)), seed=7)
    assert driver("set_v1", name="c", keys=keys, pages=list(range(8))) == [True] * 8
    assert driver("exists", name="c", keys=keys) == 8
    assert driver("get_v1", name="c", keys=keys, pages=list(range(8, 16))) == [True] * 8
    assert driver("digests", name="c", pages=list(range(8, 16))) == written
    for d in nodes:  # 16 blocks by rendezvous hashing: each node holds some
        with Client(d.address) as c:
            assert c.stats()["store"]["host"]["blocks"] > 0
