"""The CUDA IPC path: the GPU tier's pins and reservations (on a "cpu" tier here),
its wire ops on real daemons, the client's clear refusal without CUDA, and, on a CUDA
machine, two processes moving blocks through one daemon's GPU tier device to device."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import kvstore.node.gpu_tier
from kvstore import Client
from kvstore.errors import ProtocolError, Unsupported
from kvstore.keys import BlockKey
from kvstore.net import protocol as P
from kvstore.net.connection import Connection, Traffic
from kvstore.net.server import StoreServer
from kvstore.node.gpu_tier import GpuTier
from kvstore.node.store import BlockStore, StoreConfig

torch = pytest.importorskip("torch")
B = 4096
REPO = Path(__file__).resolve().parents[2]


def K(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(16, "little"))


def V(i: int) -> bytes:
    return (i.to_bytes(16, "little") * (B // 16))[:B]


def _fill(tier: GpuTier, n: int) -> None:
    for i in range(n):
        assert tier.put(K(i), 7, bytearray(V(i))) == []


# --- the tier's pins and reservations ------------------------------------------------------


def test_pinned_blocks_are_never_victims_and_unpin_frees_them():
    tier = GpuTier(4 * B, device="cpu")
    _fill(tier, 4)
    a, b = object(), object()
    assert [s is not None for s in tier.pin([K(0), K(1), K(9)], a)] == [True, True, False]
    victims = tier.put(K(10), 7, bytearray(V(10)))  # the LRU's oldest two are pinned
    assert [v[0] for v in victims] == [K(2)] and K(0) in tier and K(1) in tier
    tier.pin([K(3)], b)
    tier.pin([K(10)], b)
    assert tier.put(K(11), 7, bytearray(V(11))) == [] and K(11) not in tier  # all pinned: not stored
    with pytest.raises(KeyError):
        tier.unpin([K(3)], a)  # b's pin, not a's
    tier.unpin([K(0)], a)
    assert [v[0] for v in tier.put(K(11), 7, bytearray(V(11)))] == [K(0)]
    assert tier.release_owner(a) == (0, 1) and tier.release_owner(b) == (0, 2)
    assert [v[0] for v in tier.put(K(12), 7, bytearray(V(12)))] == [K(1)]


def test_a_pinned_block_that_leaves_keeps_its_space_until_the_last_unpin():
    tier = GpuTier(2 * B, device="cpu")
    _fill(tier, 2)
    owner = object()
    (slot,) = tier.pin([K(0)], owner)
    assert slot is not None
    dst = bytearray(B)
    assert tier.take_into(K(0), memoryview(dst)) == 7 and bytes(dst) == V(0)  # promoted to host
    assert K(0) not in tier and tier.value_bytes == B
    assert tier.put(K(5), 7, bytearray(V(5))) != []  # room only by evicting K(1), not K(0)'s space
    assert bytes(tier.buffer[slot.offset: slot.offset + B].numpy()) == V(0)
    assert tier.release_owner(owner) == (0, 1)
    assert tier.allocator.used_bytes == B  # K(0)'s space is free now
    assert tier.delete(K(5)) and tier.allocator.used_bytes == 0


def test_reservations_commit_abort_and_die_with_their_owner():
    tier = GpuTier(4 * B, device="cpu")
    owner, other = object(), object()
    slots, victims = tier.reserve([(K(1), B), (K(2), B), (K(1), B)], owner)
    assert slots is not None and victims == [] and slots[2] is None
    assert tier.holds(K(1)) and K(1) not in tier  # reserved: a put is a no-op, not yet visible
    assert tier.put(K(1), 7, bytearray(V(1))) == [] and tier.size_of(K(1)) is None
    with pytest.raises(KeyError):
        tier.commit([K(1)], other)
    s1 = slots[0]
    assert s1 is not None
    tier.buffer[s1.offset: s1.offset + B].copy_(torch.frombuffer(bytearray(V(1)), dtype=torch.uint8))
    assert tier.commit([K(1)], owner) == B and K(1) in tier
    dst = bytearray(B)
    assert tier.take_into(K(1), memoryview(dst)) is not None and bytes(dst) == V(1)  # checksummed now
    assert tier.reserve([(K(3), 3 * B)], other)[0] is None  # K(2)'s reservation holds a quarter
    assert tier.release_owner(owner) == (1, 0) and not tier.holds(K(2))
    assert tier.reserve([(K(3), 4 * B)], other)[0] is not None


def test_the_store_puts_and_reads_through_the_gpu_share(monkeypatch):
    monkeypatch.setattr(kvstore.node.gpu_tier, "DEFAULT_DEVICE", "cpu")
    with BlockStore(StoreConfig(memory_bytes=16 * B, gpu_memory_bytes=8 * B)) as store:
        share = store.gpu_share
        assert share is not None and not share.is_cuda
        store.put(K(0), V(0))
        owner = object()
        offsets = share.reserve([(K(0), B), (K(1), B)], owner)
        assert offsets[0] is None and offsets[1] is not None  # K(0) is in the host tier
        buf = store._gpu.buffer  # what a client's device-to-device copy writes
        buf[offsets[1]: offsets[1] + B].copy_(torch.frombuffer(bytearray(V(1)), dtype=torch.uint8))
        share.commit([K(1)], owner)
        assert share.pin([K(0), K(1)], owner)[0] is None
        assert store.contains([K(1)]) == [True]
        assert store.get(K(1)) == V(1)  # promoted to host while GPU-pinned: its space stays
        assert store.release_owner(owner) == (0, 1)
        assert store._gpu.allocator.used_bytes == 0
        with pytest.raises(Unsupported, match="not a CUDA device"):
            share.handle()


# --- the wire ops ---------------------------------------------------------------------------


def _open(address: str) -> Connection:
    return Connection.open(address, token=None, timeout=5, want="tcp", traffic=Traffic(),
                           use_index=False)


def test_a_daemon_without_a_gpu_tier_answers_unsupported_and_keeps_serving(shared_daemon):
    conn, other = _open(shared_daemon.address), _open(shared_daemon.address)
    try:
        assert "cuda_ipc" not in conn.hello
        for op, meta in ((P.Op.GPU_HANDLE, b""), (P.Op.GPU_PIN, P.pack_keys([K(1)])),
                         (P.Op.GPU_RESERVE, P.pack_keys_sizes([K(1)], [B])),
                         (P.Op.GPU_UNPIN, P.pack_keys([K(1)])), (P.Op.GPU_COMMIT, P.pack_keys([K(1)]))):
            with pytest.raises(Unsupported, match="no GPU tier"):
                conn.exchange(op, meta)
        _, meta = conn.exchange(P.Op.CONTAINS, P.pack_keys([K(1)]))  # the same connection goes on
        assert bytes(meta) == b"\0"
        _, meta = other.exchange(P.Op.CONTAINS, P.pack_keys([K(1)]))
        assert bytes(meta) == b"\0"
    finally:
        conn.close()
        other.close()
    with Client(shared_daemon.address) as c:
        with pytest.raises(Unsupported, match="CUDA"):
            c.get_cuda([K(1)], [torch.zeros(B, dtype=torch.uint8)])


@pytest.fixture
def cpu_tier_server(monkeypatch):
    """An in-process daemon whose GPU tier lives on "cpu" (the ops, no IPC)."""
    monkeypatch.setattr(kvstore.node.gpu_tier, "DEFAULT_DEVICE", "cpu")
    store = BlockStore(StoreConfig(memory_bytes=16 * B, gpu_memory_bytes=8 * B, shared_index=False))
    server = StoreServer(store, host="127.0.0.1", port=0, node_id="cpu-tier")
    host, port = server.bind()
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        yield store, f"{host}:{port}"
    finally:
        server.shutdown()
        t.join(10)
        store.close()


def _wait(cond) -> None:
    import time

    deadline = time.monotonic() + 5
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_gpu_ops_pin_and_reserve_for_their_connection_only(cpu_tier_server):
    store, address = cpu_tier_server
    gpu = store._gpu
    conn = _open(address)
    try:
        assert "cuda_ipc" not in conn.hello  # a tier off CUDA is not offered
        with pytest.raises(Unsupported, match="not a CUDA device"):
            conn.exchange(P.Op.GPU_HANDLE, b"")
        _, meta = conn.exchange(P.Op.GPU_RESERVE, P.pack_keys_sizes([K(1), K(2)], [B, B]))
        offs = np.frombuffer(meta, "<u8").tolist()
        assert P.MISSING not in offs
        for i, off in zip((1, 2), offs):
            gpu.buffer[off: off + B].copy_(torch.frombuffer(bytearray(V(i)), dtype=torch.uint8))
        conn.exchange(P.Op.GPU_COMMIT, P.pack_keys([K(1)]))
        _, meta = conn.exchange(P.Op.GPU_RESERVE, P.pack_keys_sizes([K(1)], [B]))
        assert np.frombuffer(meta, "<u8").tolist() == [P.MISSING]  # present: nothing to write
        _, meta = conn.exchange(P.Op.GPU_PIN, P.pack_keys([K(1), K(3)]))
        arr = np.frombuffer(meta, "<u8").tolist()
        assert arr == [offs[0], P.MISSING, B, P.MISSING]
        assert gpu._lru[K(1)].pins == 1 and gpu.holds(K(2))
    finally:
        conn.close()
    _wait(lambda: gpu._lru[K(1)].pins == 0 and not gpu.holds(K(2)))  # released with the connection
    with Client(address, transport="tcp") as c:
        assert c.get_bytes([K(1)]) == [V(1)]  # the committed bytes, through the host path


def test_unpin_of_what_the_connection_does_not_hold_closes_only_it(cpu_tier_server):
    store, address = cpu_tier_server
    store.put(K(5), V(5))
    bad, good = _open(address), _open(address)
    try:
        with pytest.raises(ProtocolError, match="not pinned"):
            bad.exchange(P.Op.GPU_UNPIN, P.pack_keys([K(5)]))
        with pytest.raises((ConnectionError, OSError, ProtocolError)):
            bad.exchange(P.Op.CONTAINS, P.pack_keys([K(5)]))
        _, meta = good.exchange(P.Op.CONTAINS, P.pack_keys([K(5)]))
        assert bytes(meta) == b"\1"
    finally:
        bad.close()
        good.close()


def test_get_cuda_and_put_cuda_over_a_cpu_tier_in_this_process(cpu_tier_server, monkeypatch):
    """The client's calls with the mapping stood in for by the in-process tier's own buffer
    (what ``open_buffer`` maps on CUDA) and CPU tensors standing in for CUDA ones."""
    from kvstore.client import cuda_path
    from kvstore.node import cuda_ipc

    store, address = cpu_tier_server
    gpu = store._gpu

    class Mapped:
        def __init__(self, conn):
            self.conn, self.buf, self.max_reserve = conn, gpu.buffer, store.gpu_share.max_reserve

        def sync(self, tensors):
            pass

    monkeypatch.setattr(cuda_ipc, "require_cuda", lambda: torch)
    monkeypatch.setattr(cuda_path, "link", lambda conn, cur: cur if cur is not None and cur.conn is conn
                        else Mapped(conn))
    monkeypatch.setattr(cuda_path, "flat", lambda torch, t, i: t.reshape(-1).view(torch.uint8))
    store.put(K(9), V(9))  # in the host tier: put_cuda writes nothing, get_cuda reads it by get
    src = [torch.frombuffer(bytearray(V(i)), dtype=torch.uint8) for i in (0, 1, 2, 9)]
    with Client(address, transport="tcp") as c:
        assert c.put_cuda([K(0), K(1), K(2), K(9)], src) == [True] * 4
        assert len(gpu) == 3 and K(9) not in gpu
        dst = [torch.zeros(B, dtype=torch.uint8) for _ in range(5)]
        assert c.get_cuda([K(0), K(1), K(2), K(9), K(7)], dst) == [True] * 4 + [False]
        assert [bytes(d.numpy()) for d in dst[:4]] == [V(0), V(1), V(2), V(9)]
        assert all(slot.pins == 0 for slot in gpu._lru.values())  # unpinned after the copies
        big = [torch.zeros(B, dtype=torch.uint8) for _ in range(6)]  # over the cap: via put
        assert c.put_cuda([K(20 + i) for i in range(6)], big) == [True] * 6
        assert c.contains([K(20 + i) for i in range(6)]) == [True] * 6


def test_the_cuda_calls_say_clearly_that_cuda_is_needed(monkeypatch):
    from kvstore.node import cuda_ipc

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(Unsupported, match="needs torch with a CUDA device"):
        cuda_ipc.open_buffer({"uuid": None, "device": 0})
    assert "is_available() is False" in (cuda_ipc.cuda_missing() or "")


# --- the real thing: two processes on one GPU -----------------------------------------------

_WRITER = """
import sys, torch
from kvstore import Client
from kvstore.keys import BlockKey
n, size = int(sys.argv[2]), int(sys.argv[3])
g = torch.Generator().manual_seed(16)
src = [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g).cuda() for _ in range(n)]
with Client(sys.argv[1]) as c:
    assert c.put_cuda([BlockKey(i.to_bytes(16, "little")) for i in range(n)], src) == [True] * n
    assert c.stats()["store"]["gpu"]["blocks"] == n
print("ok")
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_two_processes_move_blocks_through_the_gpu_tier(start_daemon):
    d = start_daemon("--gpu-memory", "64M")
    n, size = 8, 1 << 16
    r = subprocess.run([sys.executable, "-c", _WRITER, d.address, str(n), str(size)], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr
    g = torch.Generator().manual_seed(16)
    want = [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g) for _ in range(n)]
    dst = [torch.zeros(size, dtype=torch.uint8, device="cuda") for _ in range(n)]
    with Client(d.address) as c:
        assert c.get_cuda([K(i) for i in range(n)], dst) == [True] * n
        assert c.stats()["store"]["gpu"]["hits"] == n  # read over IPC, not promoted to host
    assert all(torch.equal(a.cpu(), b) for a, b in zip(dst, want))


def test_the_gpu_checks_section_sizes_smollm2_blocks_and_is_unsupported_without_cuda(tmp_path):
    from gpucheck import ipc
    from gpucheck.runner import Ctx
    from gpucheck.runner import Unsupported as SectionUnsupported

    assert ipc.block_bytes() == 30 * 2 * 16 * 3 * 64 * 2  # layers, K and V, tokens, heads, dim, bf16
    ctx = Ctx(device="cpu", selftest=True, work=tmp_path, out=tmp_path, log_file=None)
    with pytest.raises(SectionUnsupported, match="no CUDA"):
        ipc.run(ctx, {})


def test_no_gpu_op_is_served_before_hello(cpu_tier_server):
    import socket

    _, address = cpu_tier_server
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(P.pack_header(P.Op.GPU_PIN, 0, 1, 20) + P.pack_keys([K(1)]))
        head = sock.recv(P.HEADER_SIZE, socket.MSG_WAITALL)
        h = P.unpack_header(head)
        assert h.flags & P.FLAG_ERROR
        meta = sock.recv(h.meta_len, socket.MSG_WAITALL)
        assert P.error_from_meta(meta).__class__.__name__ == "AuthError"
        try:  # and closed (reset: the meta it never read)
            assert sock.recv(1) == b""
        except ConnectionResetError:
            pass
