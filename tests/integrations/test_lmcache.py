"""The store as an LMCache storage plugin, with the real LMCache: LMCache's own engine
(``LMCacheEngineBuilder``, a paged vLLM connector of LMCache's on CPU tensors) in
.venv-lmcache processes (tests/integrations/lmcache_driver.py), real ``kvstore serve`` daemons.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.daemons import DaemonFactory

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv-lmcache" / "bin" / "python"
SECRET = "lmcache-test-secret"


class Driver:
    """One LMCache process; ``send`` a command, get its answer (tests fail on an error)."""

    def __init__(self, log: Path) -> None:
        env = {**os.environ, "KVCACHE_CLUSTER_SECRET": SECRET, "PYTHONPATH": str(ROOT),
               "OMP_NUM_THREADS": "1", "LMCACHE_LOG_LEVEL": "WARNING"}
        self._log = log.open("w")
        self.proc = subprocess.Popen([str(PYTHON), "-m", "tests.integrations.lmcache_driver"],
                                     cwd=ROOT, env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True)

    def send(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the LMCache driver died; its log: {self._log.name}"
        out = json.loads(line)
        assert "error" not in out, out["error"]
        return out

    def close(self) -> None:
        """End of input ends the driver (it closes its engines); killed if it hangs."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(30)
            except (subprocess.TimeoutExpired, BrokenPipeError):
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture
def lmcache(tmp_path: Path) -> Iterator[Any]:
    if not PYTHON.exists():
        pytest.skip("the LMCache environment is not built: bash scripts/setup_lmcache.sh")
    drivers: list[Driver] = []

    def start() -> Driver:
        drivers.append(Driver(tmp_path / f"lmcache{len(drivers)}.log"))
        return drivers[-1]

    try:
        yield start
    finally:
        for d in drivers:
            d.close()


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[DaemonFactory]:
    factory = DaemonFactory(tmp_path / "daemons")
    try:
        yield factory
    finally:
        factory.close()


def test_chunks_come_back_bit_for_bit_in_this_process_and_another(lmcache, daemons):
    d = daemons(memory="256M", env={"KVCACHE_CLUSTER_SECRET": SECRET})
    a = lmcache()
    for name, transport in (("shm", "auto"), ("tcp", "tcp")):
        assert "kvstore" in a.send(op="open", name=name, model="m1", address=d.address,
                                   transport=transport)["backends"]
    stored = a.send(op="store", name="shm", seed=1, tokens=600, slot=0)["digests"]
    assert a.send(op="stats", name="shm")["stored"] == 3  # two full chunks and the last 88 tokens
    for name in ("shm", "tcp"):  # LMCache's CPU cache is off: each retrieve reads the store
        got = a.send(op="retrieve", name=name, seed=1, tokens=600, slot=2048)
        assert got == {"retrieved": 600, "digest": stored["600"]}
    assert a.send(op="retrieve", name="tcp", seed=2, tokens=600, slot=2048)["retrieved"] == 0
    b = lmcache()  # another process: the same keys (nothing in LMCache's keys is per process)
    b.send(op="open", name="b", model="m1", address=d.address)
    assert b.send(op="retrieve", name="b", seed=1, tokens=512, slot=1024) == \
        {"retrieved": 512, "digest": stored["512"]}
    # Another model's chunks of the same tokens never collide with these.
    b.send(op="open", name="other", model="m2", address=d.address)
    assert b.send(op="retrieve", name="other", seed=1, tokens=600, slot=0)["retrieved"] == 0
    other = b.send(op="store", name="other", seed=1, kv_seed=7, tokens=600, slot=0)["digests"]
    assert other["600"] != stored["600"]
    assert a.send(op="retrieve", name="shm", seed=1, tokens=600, slot=2048)["digest"] == stored["600"]
    assert b.send(op="retrieve", name="other", seed=1, tokens=600, slot=2048)["digest"] == other["600"]


def test_a_dead_or_full_store_is_a_miss_not_an_error(lmcache, daemons):
    env = {"KVCACHE_CLUSTER_SECRET": SECRET}
    d, small = daemons(memory="256M", env=env), daemons(memory="16M", env=env)
    a = lmcache()
    a.send(op="open", name="full", model="m1", address=small.address)
    a.send(op="store", name="full", seed=3, tokens=512, slot=0)  # 11.8 MB chunks, a 4 MB cap
    assert a.send(op="stats", name="full")["put_dropped"] == 2
    assert a.send(op="retrieve", name="full", seed=3, tokens=512, slot=2048)["retrieved"] == 0
    a.send(op="open", name="live", model="m1", address=d.address)
    stored = a.send(op="store", name="live", seed=4, tokens=512, slot=0)["digests"]
    d.kill()
    assert a.send(op="retrieve", name="live", seed=4, tokens=512, slot=2048)["retrieved"] == 0
    a.send(op="store", name="live", seed=5, tokens=256, slot=0)  # dropped, not raised
    stats = a.send(op="stats", name="live")
    assert stats["unavailable"] >= 1 and stats["put_dropped"] >= 1, stats
    d2 = daemons(memory="256M", env=env)  # a store back at another address: a fresh rig finds it
    a.send(op="open", name="back", model="m1", address=d2.address)
    again = a.send(op="store", name="back", seed=4, tokens=512, slot=0)["digests"]
    assert again == stored
    assert a.send(op="retrieve", name="back", seed=4, tokens=512, slot=2048) == \
        {"retrieved": 512, "digest": stored["512"]}
