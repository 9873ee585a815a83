"""A bounded fuzz of the daemon's wire: thousands of random and half-valid frames from many
connections. The daemon keeps serving a good client, and gives back the memory the fuzz
made it use (anonymous RSS within 64 MiB of where it started)."""

from __future__ import annotations

import os
import random
import socket
import struct
import threading
import time

import pytest

from kvstore import Client
from kvstore.keys import BlockKey
from kvstore.net import protocol as P
from tests.kvstore.test_bad_input import port_of
from tests.kvstore.test_hardening import MiB, rss_anon, wait_for

pytestmark = pytest.mark.integration

FRAMES = 5000
TIME_LIMIT_S = 30.0


def random_frame(rng: random.Random) -> bytes:
    """One frame: valid ones, ones with lengths that lie, garbage."""
    kind = rng.random()
    keys = [os.urandom(16) for _ in range(rng.randint(1, 8))]
    if kind < 0.3:  # valid requests
        op = rng.choice([P.Op.CONTAINS, P.Op.GET, P.Op.PREFIX_LEN, P.Op.DELETE, P.Op.PIN])
        meta = P.pack_keys(keys)
        return P.pack_header(op, 0, rng.randint(1, 1 << 30), len(meta)) + meta
    if kind < 0.45:  # a valid small PUT, or one whose sizes lie
        sizes = [rng.randint(1, 4096) for _ in keys]
        meta = P.pack_keys_sizes(keys, sizes)
        data_len = sum(sizes) if rng.random() < 0.5 else rng.randint(0, 1 << 24)
        return P.pack_header(P.Op.PUT, 0, 2, len(meta), data_len) + meta + os.urandom(min(data_len, 8192))
    if kind < 0.75:  # headers that claim large metas (up to the old 16 MiB limit), partial metas
        op = rng.randint(0, 14)
        meta_len = rng.choice([16 * MiB, rng.randint(0, 16 * MiB), rng.randint(0, 1 << 16)])
        return P.pack_header(op, rng.choice([0, 0, 1, 4]), 2, meta_len, 0) + os.urandom(rng.randint(0, 2048))
    if kind < 0.9:  # random header fields behind a good magic
        return P.HEADER.pack(P.MAGIC, rng.choice([1, 1, 2]), rng.randint(0, 255), rng.randint(0, 7),
                             rng.getrandbits(64), rng.getrandbits(32), rng.getrandbits(32),
                             rng.getrandbits(64)) + os.urandom(rng.randint(0, 256))
    return os.urandom(rng.randint(1, 512))  # garbage


def fuzz_worker(port: int, seed: int, budget: list[int], deadline: float) -> None:
    rng = random.Random(seed)
    hello_meta = P.pack_json({"token": None, "host_id": "fuzz", "pid": 0})
    hello = P.pack_header(P.Op.HELLO, 0, 1, len(hello_meta)) + hello_meta
    while time.monotonic() < deadline:
        if budget[0] <= 0:  # shared by the workers; a few frames over is fine
            return
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=2)
        except OSError:
            continue
        with s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST on close
            try:
                if rng.random() < 0.9:
                    s.sendall(hello)
                for _ in range(rng.randint(1, 6)):
                    budget[0] -= 1
                    s.sendall(random_frame(rng))
                    s.settimeout(0.05)
                    try:
                        if s.recv(1 << 16) == b"":
                            break
                    except socket.timeout:
                        pass
            except OSError:
                pass


def test_fuzz_keeps_serving_and_gives_memory_back(start_daemon):
    d = start_daemon("--frame-timeout", "2")
    pid = d.proc.pid
    with Client(d.address, transport="tcp") as good:
        keys = [BlockKey(os.urandom(16)) for _ in range(8)]
        values = [os.urandom(64 << 10) for _ in keys]
        good.put(keys, values)
        start = rss_anon(pid)
        budget = [FRAMES]
        deadline = time.monotonic() + TIME_LIMIT_S
        workers = [threading.Thread(target=fuzz_worker, args=(port_of(d), seed, budget, deadline))
                   for seed in range(4)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(TIME_LIMIT_S + 10)
        assert budget[0] <= 0, f"only {FRAMES - budget[0]} frames within {TIME_LIMIT_S} s"
        wait_for(lambda: good.stats()["server"]["connections"] == 1, 10,
                 "fuzz connections still open")
        assert good.get_bytes(keys) == values
        grown = rss_anon(pid) - start
        print(f"fuzz: {FRAMES - budget[0]} frames, anonymous RSS {start / MiB:.0f} MiB -> "
              f"{(start + grown) / MiB:.0f} MiB")
        assert grown < 64 * MiB, f"anonymous RSS {grown / MiB:.0f} MiB above its start after the fuzz"
