"""Same-host gets through the daemon's shared-memory index, against real daemons: no message on
the fast path, reads reported as TOUCH (recency, tail before head; hit counters), the PIN path
wherever the index does not settle a get, daemon restarts, and a concurrent writer/evictor in
another process that never makes a get return foreign or torn bytes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvstore import Client, StoreUnavailable
from kvstore.keys import BlockKey
from kvstore.net.buffers import Sink
from kvstore.proc import free_port

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
SHM = Path("/dev/shm")


def rand_keys(n: int) -> list[BlockKey]:
    return [BlockKey(os.urandom(16)) for _ in range(n)]


def content(key: bytes, size: int) -> np.ndarray:
    return np.frombuffer(key * (size // 16), np.uint8)


class Keep(Sink):
    def __init__(self, size: int) -> None:
        super().__init__(np.zeros(size, np.uint8))
        self.got: list[bytes] = []

    def consume(self, block: np.ndarray) -> None:
        self.got.append(block.tobytes())


def test_a_get_sends_nothing_and_its_reads_are_reported(start_daemon):
    d = start_daemon()
    keys = rand_keys(4)
    with Client(d.address) as c:
        assert c.transport == "shm" and c.index_reads
        c.put(keys[:3], [content(k, 4096) for k in keys[:3]])
        sent, hits = c.bytes_sent, c.index_hits
        bufs = [np.zeros(4096, np.uint8) for _ in keys[:3]]
        assert c.get(keys[:3], bufs) == [True] * 3
        assert all(np.array_equal(b, content(k, 4096)) for b, k in zip(bufs, keys))
        assert c.bytes_sent == sent and c.index_hits == hits + 3  # not one byte to the daemon
        assert c.get_bytes(keys[:2]) == [content(k, 4096).tobytes() for k in keys[:2]]
        assert c.index_hits == hits + 5
        # a key the index does not hold goes to the daemon (PIN), the others do not
        assert c.get(keys[2:], [np.zeros(4096, np.uint8)] * 2) == [True, False]
        assert c.bytes_sent > sent and c.index_hits == hits + 6
        sink = Keep(4096)  # a Sink consumes the block where it lies: the PIN path
        assert c.get(keys[:1], [sink]) == [True] and sink.got == [content(keys[0], 4096).tobytes()]
        assert c.index_hits == hits + 6
    with Client(d.address, transport="tcp") as t:  # close() waited for the TOUCH to be taken
        host = t.stats()["store"]["host"]
        assert host["hits"] == 7 and host["misses"] == 1 and host["bytes_out"] == 7 * 4096


def test_reads_are_reported_within_the_touch_delay_with_no_other_request(start_daemon, monkeypatch):
    from kvstore.net import connection

    monkeypatch.setattr(connection, "TOUCH_DELAY_S", 0.05)
    d = start_daemon()
    key = rand_keys(1)[0]
    with Client(d.address) as c, Client(d.address, transport="tcp") as t:
        c.put([key], [b"v" * 4096])
        buf = np.zeros(4096, np.uint8)
        assert c.get([key], [buf]) == [True]
        time.sleep(0.06)
        sent = c.bytes_sent
        assert c.get([key], [buf]) == [True] and c.bytes_sent > sent  # the one-way TOUCH
        deadline = time.monotonic() + 5
        while t.stats()["store"]["host"]["hits"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert t.stats()["store"]["host"]["hits"] == 2


def test_reads_count_toward_recency_tail_before_head(start_daemon):
    """Room for 8 blocks of 128 KiB; a commit over 95% evicts down to 85% (2 blocks)."""
    d = start_daemon(memory="1M")
    size = 128 << 10
    xs, ys = rand_keys(7), rand_keys(5)
    with Client(d.address) as c:
        for k in xs:  # xs[0] the least recent
            c.put([k], [content(k, size)])
        assert c.get([xs[1], xs[0]], [np.zeros(size, np.uint8)] * 2) == [True, True]
        assert c.index_hits == 2  # a prefix read with no message: xs[1] its head, xs[0] its tail
        c.put([ys[0]], [content(ys[0], size)])  # the TOUCH goes first: xs[2], xs[3] evicted
        assert c.contains(xs) == [True, True, False, False, True, True, True]
        for y in ys[1:5]:
            c.put([y], [content(y, size)])  # evicts xs[4..6] and then the tail xs[0] ...
        assert c.contains(xs[:2]) == [False, True]  # ... while its head xs[1] stays
        stats = c.stats()["store"]["host"]
        assert stats["hits"] == 2 and stats["evictions"] == 6


def test_without_an_index_gets_take_the_pin_path(start_daemon):
    keys, vals = rand_keys(2), [b"a" * 5000, b"b" * 7000]
    plain = start_daemon("--no-shared-index")
    indexed = start_daemon()
    hello_index = SHM / next(p.name for p in SHM.glob(f"kvstore-{indexed.proc.pid}-*")
                             if p.name != indexed.arena)
    hello_index.unlink()  # the index of HELLO cannot be mapped: the arena still can
    for c in (Client(plain.address), Client(indexed.address), Client(indexed.address, shared_index=False)):
        with c:
            assert c.transport == "shm" and not c.index_reads
            c.put(keys, vals)
            assert c.get_bytes(keys) == vals and c.get(keys, [bytearray(8000)] * 2) == [True] * 2
            assert c.index_hits == 0
            c.delete(keys)


def test_a_restarted_daemon_is_never_read_through_the_old_index(start_daemon):
    port = free_port()
    key, size = rand_keys(1)[0], 8192
    old = start_daemon("--port", str(port))
    c = Client(old.address)
    c.put([key], [np.full(size, 1, np.uint8)])
    buf = np.zeros(size, np.uint8)
    assert c.get([key], [buf]) == [True] and c.index_hits == 1
    for stop in ("kill", "stop"):  # SIGKILL (no closed mark in the index), then SIGTERM
        old.kill() if stop == "kill" else old.stop()
        new = start_daemon("--port", str(port))
        with Client(new.address, transport="tcp") as w:
            w.put([key], [np.full(size, 2 if stop == "kill" else 3, np.uint8)])
        try:
            found = c.get([key], [buf])  # the dead connection: detected before the index is read
        except StoreUnavailable:
            found = c.get([key], [buf])  # reconnected: the new daemon's index
        assert found == [True] and set(buf.tolist()) == {2 if stop == "kill" else 3}
        assert c.index_reads
        old = new
    c.close()


WRITER = """
import os, sys, time
import numpy as np
from kvstore import Client
from kvstore.keys import BlockKey
addr, seconds, size = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
pool = [BlockKey(bytes.fromhex(h)) for h in sys.argv[4].split(",")]
rng = np.random.default_rng(2)
with Client(addr) as c:
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        ks = [pool[int(i)] for i in rng.integers(len(pool), size=4)]
        c.put(ks, [np.frombuffer(k * (size // 16), np.uint8) for k in ks])
        if n % 3 == 0:
            c.delete(ks[:1])
        n += 1
print(n)
"""


def test_a_concurrent_writer_and_evictor_never_makes_a_get_return_foreign_bytes(start_daemon):
    """Another process puts, deletes and (a 2 MiB arena, 64 KiB blocks) evicts all the time;
    every block a get returns here must be exactly its key's bytes."""
    d = start_daemon(memory="2M")
    size, pool = 64 << 10, rand_keys(64)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, d.address, "2", str(size),
                               ",".join(k.hex() for k in pool)], cwd=REPO, stdout=subprocess.PIPE,
                              text=True)
    bufs = [np.zeros(size, np.uint8) for _ in range(4)]
    rng = np.random.default_rng(3)
    found_total = 0
    try:
        with Client(d.address) as c:
            end = time.monotonic() + 1.8
            while time.monotonic() < end:
                ks = [pool[int(i)] for i in rng.integers(len(pool), size=4)]
                for k, b, ok in zip(ks, bufs, c.get(ks, bufs)):
                    if ok:
                        found_total += 1
                        assert np.array_equal(b, content(k, size)), "a get returned foreign bytes"
            hits = c.index_hits
    finally:
        out, _ = writer.communicate(timeout=30)
    assert writer.returncode == 0 and int(out) > 50
    assert hits > 100 and found_total >= hits, (hits, found_total)
