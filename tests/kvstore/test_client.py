"""Client against real daemon processes: both paths, every buffer kind, concurrency, failure."""

import asyncio
import os
import socket
import threading
import time

import numpy as np
import pytest
import torch

import kvstore
from kvstore import AsyncClient, Client, StoreUnavailable
from kvstore.keys import BlockKey
from kvstore.net import protocol as P
from kvstore.net.buffers import Parts, Sink

pytestmark = pytest.mark.integration
torch.set_num_threads(1)


def rand_keys(n: int) -> list[BlockKey]:
    return [BlockKey(os.urandom(16)) for _ in range(n)]


def blocks(n: int, size: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]


TRANSPORTS = ["auto", "tcp", "ucx"]  # auto: shared memory here; ucx: a daemon that serves it


def daemon_for(request, transport: str):
    return request.getfixturevalue("ucx_daemon" if transport == "ucx" else "shared_daemon")


@pytest.fixture(params=TRANSPORTS)
def client(request):
    with Client(daemon_for(request, request.param).address, transport=request.param) as c:
        assert c.transport == ("shm" if request.param == "auto" else request.param)
        yield c


def test_roundtrip_every_buffer_kind(client):
    keys = rand_keys(5)
    t = torch.arange(64, dtype=torch.bfloat16).reshape(4, 16)  # no NumPy bfloat16: uint8 view
    values = [b"a" * 100, bytearray(b"b" * 200), np.arange(50, dtype=np.float32),
              memoryview(b"c" * 300), t]
    client.put(keys, values)
    dst = [bytearray(100), np.zeros(200, np.uint8), np.zeros(50, np.float32),
           memoryview(bytearray(400)), torch.zeros(4, 16, dtype=torch.bfloat16)]
    assert client.get(keys, dst) == [True] * 5
    assert dst[0] == b"a" * 100 and bytes(dst[1]) == b"b" * 200
    np.testing.assert_array_equal(dst[2], np.arange(50, dtype=np.float32))
    assert bytes(dst[3][:300]) == b"c" * 300 and bytes(dst[3][300:]) == bytes(100)
    assert torch.equal(dst[4], t)
    assert client.get_bytes(keys[:2]) == [b"a" * 100, b"b" * 200]
    assert client.delete(keys) == 5


def test_batch_semantics(client):
    keys = rand_keys(64)
    vals = blocks(64, 4096)
    client.put(keys[:32], vals[:32])
    assert client.contains(keys[30:34]) == [True, True, False, False]
    assert client.prefix_len(keys) == 32
    bufs = [np.zeros(4096, np.uint8) for _ in keys]
    found = client.get(keys, bufs)
    assert found == [True] * 32 + [False] * 32
    assert all(np.array_equal(b, v) for b, v in zip(bufs[:32], vals[:32]))
    assert not bufs[40].any()
    # immutable: a put of a present key is a no-op, the first copy stays
    client.put(keys[:1], [np.zeros(4096, np.uint8)])
    assert client.get_bytes(keys[:1]) == [vals[0].tobytes()]
    assert client.get_bytes(rand_keys(1)) == [None]
    assert client.delete(keys) == 32 and client.prefix_len(keys) == 0


def test_buffer_errors_are_clear_and_keep_the_client_usable(client):
    keys = rand_keys(1)
    client.put(keys, [b"x" * 1000])
    with pytest.raises(ValueError, match="holds 10 bytes"):
        client.get(keys, [bytearray(10)])
    with pytest.raises(ValueError, match="read-only"):
        client.get(keys, [b"y" * 1000])
    with pytest.raises(ValueError, match="keys but"):
        client.put(keys, [])
    assert client.get_bytes(keys) == [b"x" * 1000]  # reconnects if it had to
    assert client.delete(keys) == 1


def test_store_full_fails_the_keys_that_did_not_fit_and_leaves_nothing_of_them(client):
    before = client.stats()["store"]["host"]
    keys = rand_keys(3)
    big = np.zeros(80 << 20, np.uint8)  # larger than the 64 MiB arena
    assert client.put(keys, [big] * 3) == [False] * 3
    after = client.stats()["store"]["host"]
    assert client.contains(keys) == [False] * 3
    assert after["allocated_bytes"] == before["allocated_bytes"]
    keys = rand_keys(3)  # the leading run that fits is stored; from the first misfit on, none
    assert client.put(keys, [b"a" * 1000, big, b"c" * 1000]) == [True, False, False]
    assert client.contains(keys) == [True, False, False]
    assert client.put(keys[:1], [b"a" * 1000]) == [True]  # present: a successful no-op
    assert client.get_bytes(keys[:1]) == [b"a" * 1000]  # the connection still serves


def test_a_value_of_parts_is_stored_as_their_concatenation(client):
    head, body = np.arange(64, dtype=np.uint8), torch.arange(1000, dtype=torch.float32)
    keys = rand_keys(2)
    assert client.put(keys, [Parts(head, body), Parts(b"x")]) == [True, True]
    want = head.tobytes() + body.numpy().tobytes()
    assert client.get_bytes(keys) == [want, b"x"]


def test_values_of_parts_survive_memory_reuse_while_in_flight(client):
    """UCX joins a value's parts into a temporary for its one send, and reads it by address
    until the send ends: the temporary must outlive the send, whatever the allocator does
    meanwhile (here: many values, large enough to go by rendezvous, in one put)."""
    heads = [np.full(64, i, np.uint8) for i in range(16)]
    bodies = [torch.full((64 * 1024,), float(i)) for i in range(16)]
    for _ in range(3):
        keys = rand_keys(16)
        assert client.put(keys, [Parts(h, b) for h, b in zip(heads, bodies)]) == [True] * 16
        got = client.get_bytes(keys)
        for i, g in enumerate(got):
            assert g == heads[i].tobytes() + bodies[i].numpy().tobytes(), f"value {i} differs"


class Split(Sink):
    """Lands a block of ``size`` bytes in two arrays (its first 8 bytes apart) when asked."""

    def __init__(self, size: int) -> None:
        super().__init__(np.zeros(size, np.uint8))
        self.head, self.body = np.zeros(8, np.uint8), np.zeros(size - 8, np.uint8)
        self.got: bytes | None = None
        self.how = ""

    def landing(self, size: int):
        return [self.head, self.body[:size - 8]] if size == len(self.body) + 8 else None

    def landed(self, size: int) -> None:
        self.got, self.how = self.head.tobytes() + self.body[:size - 8].tobytes(), "landed"

    def consume(self, block) -> None:
        self.got, self.how = bytes(block), "consumed"


def test_a_sink_may_land_a_block_where_it_asks_over_tcp(client):
    keys = rand_keys(3)
    vals = [os.urandom(1000), os.urandom(600), os.urandom(1000)]
    client.put(keys, vals)
    sinks = [Split(1000) for _ in keys]
    assert client.get(keys, sinks) == [True] * 3
    assert [s.got for s in sinks] == vals
    want = "consumed" if client.transport == "shm" else "landed"  # shm: where it lies
    assert [s.how for s in sinks] == [want, "consumed", want]


def test_a_part_that_cannot_fit_stores_its_leading_run(start_daemon):
    """Reservations of other connections hold 14 of the arena's 16 MiB (never evictable): a
    put of 0.4 + 0.4 + 2.5 MiB, one request, does not fit as a whole, nor does its last block
    alone; the two before it do."""
    d = start_daemon(memory="16M")
    with Client(d.address) as c0, Client(d.address) as c1, Client(d.address) as c2, \
            Client(d.address) as c3, Client(d.address) as c:
        assert c.transport == "shm"
        for holder, size in ((c0, 4 << 20), (c1, 4 << 20), (c2, 4 << 20), (c3, 2 << 20)):
            holder._connection().exchange(P.Op.RESERVE, P.pack_keys_sizes(rand_keys(1), [size]),
                                          expect=8)
        keys = rand_keys(3)
        sizes = [400 << 10, 400 << 10, 2560 << 10]
        assert c.put(keys, [np.full(n, i, np.uint8) for i, n in enumerate(sizes)]) == [True, True, False]
        assert c.contains(keys[2:]) == [False]
        assert c.stats()["store"]["host"]["allocated_bytes"] <= 15 << 20  # nothing of it held


def test_shm_path_sends_no_kv_bytes_over_the_socket(shared_daemon):
    keys, vals = rand_keys(16), blocks(16, 360 << 10)
    payload = 16 * (360 << 10)
    with Client(shared_daemon.address) as shm, Client(shared_daemon.address, transport="tcp") as tcp:
        assert shm.transport == "shm"
        shm.put(keys, vals)
        bufs = [np.empty(360 << 10, np.uint8) for _ in keys]
        assert shm.get(keys, bufs) == [True] * 16
        assert all(np.array_equal(b, v) for b, v in zip(bufs, vals))
        assert shm.bytes_sent + shm.bytes_received < 4096  # keys and offsets only
        tcp.get(keys, bufs)
        assert tcp.bytes_received >= payload
        shm.delete(keys)


@pytest.mark.parametrize("other", ["tcp", "ucx"])
def test_two_concurrent_clients_putting_the_same_keys(request, other):
    shared_daemon = daemon_for(request, other)
    keys, vals = rand_keys(200), blocks(200, 8192, seed=1)
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def writer(transport: str) -> None:
        try:
            with Client(shared_daemon.address, transport=transport) as c:
                barrier.wait(5)
                for i in range(0, 200, 20):
                    c.put(keys[i:i + 20], vals[i:i + 20])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(t,)) for t in ("auto", other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    with Client(shared_daemon.address) as c:
        assert c.get_bytes(keys) == [v.tobytes() for v in vals]
        assert c.delete(keys) == 200  # one copy each


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_thread_safe_client_shared_by_threads(request, transport):
    with Client(daemon_for(request, transport).address, transport=transport) as c:
        def work(seed: int) -> bool:
            keys, vals = rand_keys(8), blocks(8, 1024, seed)
            c.put(keys, vals)
            ok = c.get_bytes(keys) == [v.tobytes() for v in vals]
            c.delete(keys)
            return ok

        results = []
        threads = [threading.Thread(target=lambda s=s: results.append(work(s))) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert results == [True] * 4


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_async_client(request, transport):
    address = daemon_for(request, transport).address

    async def main() -> None:
        async with AsyncClient(address, concurrency=2, transport=transport) as c:
            keys, vals = rand_keys(4), blocks(4, 2048)
            await c.put(keys, vals)
            got = await asyncio.gather(*(c.get_bytes([k]) for k in keys))
            assert [g[0] for g in got] == [v.tobytes() for v in vals]
            assert await c.prefix_len(keys) == 4 and await c.delete(keys) == 4

    asyncio.run(main())


def test_connect_by_address(shared_daemon):
    with kvstore.connect(shared_daemon.address) as c:
        assert isinstance(c, Client) and c.node_id == shared_daemon.node_id
        client: kvstore.StoreClient = c  # what the engine's connector is typed against
        assert isinstance(client, kvstore.StoreClient)
    with pytest.raises(ValueError, match="exactly one"):
        kvstore.connect()


def test_unreachable_daemon_fails_fast():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: refused
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable, match="kvstore serve"):
        Client(f"127.0.0.1:{port}", timeout=1.0)
    assert time.monotonic() - t0 < 1.0


def test_silent_peer_times_out_as_unavailable():
    with socket.socket() as listener:  # accepts (backlog) but never answers the HELLO
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable):
            Client("127.0.0.1:%d" % listener.getsockname()[1], timeout=0.3)
        assert time.monotonic() - t0 < 2.0


@pytest.mark.parametrize("transport", ["auto", "ucx"])
def test_killed_daemon_fails_fast(start_daemon, transport):
    if transport == "ucx":
        from kvstore.net import ucx

        if ucx.available() is not None:
            pytest.skip(ucx.available())
    d = start_daemon(*(["--ucx"] if transport == "ucx" else []))
    c = Client(d.address, transport=transport)
    keys = rand_keys(2)
    c.put(keys, [b"1" * 64, b"2" * 64])
    d.kill()
    for _ in range(2):  # the broken connection, then the refused reconnect
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable):
            c.get_bytes(keys)
        assert time.monotonic() - t0 < 1.0
    c.close()


@pytest.mark.gpu
def test_cuda_tensors_go_through_staging(shared_daemon):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    with Client(shared_daemon.address) as c:
        keys = rand_keys(2)
        src = [torch.arange(1024, dtype=torch.float16, device="cuda") + i for i in range(2)]
        c.put(keys, src)
        dst = [torch.zeros(1024, dtype=torch.float16, device="cuda") for _ in range(2)]
        assert c.get(keys, dst) == [True, True]
        assert all(torch.equal(a, b) for a, b in zip(src, dst))
        c.delete(keys)
