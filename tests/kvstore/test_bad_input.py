"""Bad input: the daemon answers an error or closes that one connection, keeps serving
every other client, and leaks no reserved space."""

import os
import socket
import struct
import time

import pytest

from kvstore import AuthError, Client, ProtocolError
from kvstore.keys import BlockKey
from kvstore.net import protocol as P
from kvstore.net import sockio

pytestmark = pytest.mark.integration


def port_of(d) -> int:
    return int(d.address.rsplit(":", 1)[1])


def read_frame(sock):
    """(header, meta), or None when the daemon closed the connection."""
    hdr = bytearray(P.HEADER_SIZE)
    try:
        sockio.recv_exact(sock, memoryview(hdr))
    except ConnectionError:
        return None
    h = P.unpack_header(hdr)
    meta = bytearray(h.meta_len)
    sockio.recv_exact(sock, memoryview(meta))
    return h, meta


def closed(sock) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def raw(d, *, authed=True, token=None) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port_of(d)), timeout=5)
    if authed:
        meta = P.pack_json({"token": token, "host_id": "elsewhere", "pid": 0})
        s.sendall(P.pack_header(P.Op.HELLO, 0, 1, len(meta)) + meta)
        h, _ = read_frame(s)
        assert not h.flags & P.FLAG_ERROR
    return s


def wait_alone(client: Client, timeout: float = 5.0) -> None:
    """Wait until ``client``'s is the daemon's only connection: every bad one was torn down
    (and so released what it held)."""
    deadline = time.monotonic() + timeout
    while client.stats()["server"]["connections"] != 1:
        assert time.monotonic() < deadline, "the daemon did not drop the bad connections"
        time.sleep(0.01)


def expect_error(sock, exc_type, match=""):
    frame = read_frame(sock)
    assert frame is not None, "daemon closed without an error frame"
    h, meta = frame
    assert h.flags & P.FLAG_ERROR
    err = P.error_from_meta(meta)
    assert type(err) is exc_type and match in str(err), err
    return err


@pytest.fixture
def healthy(shared_daemon):
    """A well-behaved client that must keep working around every bad one, and a check that
    the arena holds no leaked reservation afterwards."""
    with Client(shared_daemon.address, transport="tcp") as c:
        base = c.stats()["store"]["host"]["allocated_bytes"]
        keys = [BlockKey(os.urandom(16)) for _ in range(2)]
        c.put(keys, [b"ok" * 100] * 2)
        yield c
        wait_alone(c)
        assert c.get_bytes(keys) == [b"ok" * 100] * 2
        c.delete(keys)
        assert c.stats()["store"]["host"]["allocated_bytes"] == base


BAD_HEADERS = {
    "magic": P.HEADER.pack(b"GET ", 1, P.Op.STATS, 0, 2, 0, 0, 0),
    "version": P.HEADER.pack(P.MAGIC, 9, P.Op.STATS, 0, 2, 0, 0, 0),
    "meta_len": P.HEADER.pack(P.MAGIC, 1, P.Op.STATS, 0, 2, 2**32 - 1, 0, 0),
    "data_len": P.HEADER.pack(P.MAGIC, 1, P.Op.PUT, 0, 2, 4, 0, 2**63),
    "unknown_op": P.HEADER.pack(P.MAGIC, 1, 200, 0, 2, 0, 0, 0),
    "data_on_get": P.HEADER.pack(P.MAGIC, 1, P.Op.GET, 0, 2, 4, 0, 10),
    "response_flag": P.HEADER.pack(P.MAGIC, 1, P.Op.STATS, P.FLAG_RESPONSE, 2, 0, 0, 0),
}


@pytest.mark.parametrize("name", sorted(BAD_HEADERS))
def test_bad_header_gets_protocol_error_and_close(shared_daemon, healthy, name):
    with raw(shared_daemon) as s:
        s.sendall(BAD_HEADERS[name])
        expect_error(s, ProtocolError)
        assert closed(s)


def test_truncated_frames_are_dropped(shared_daemon, healthy):
    with raw(shared_daemon) as s:  # a header cut short
        s.sendall(P.pack_header(P.Op.STATS, 0, 2, 0)[:10])
    with raw(shared_daemon) as s:  # meta cut short
        s.sendall(P.pack_header(P.Op.CONTAINS, 0, 2, 1000) + b"\x00" * 10)
    key = BlockKey(os.urandom(16))
    with raw(shared_daemon) as s:  # a PUT whose data stops half way: reserved, then aborted
        meta = P.pack_keys_sizes([key], [1 << 20])
        s.sendall(P.pack_header(P.Op.PUT, 0, 2, len(meta), 1 << 20) + meta + b"x" * 1000)
    wait_alone(healthy)  # the fixture then checks that nothing stayed reserved
    assert healthy.contains([key]) == [False]


def test_malformed_meta(shared_daemon, healthy):
    with raw(shared_daemon) as s:
        meta = struct.pack("<I", 5) + os.urandom(16)  # claims 5 keys, holds 1
        s.sendall(P.pack_header(P.Op.GET, 0, 2, len(meta)) + meta)
        expect_error(s, ProtocolError, "does not hold")
        assert closed(s)


def test_block_sizes_that_do_not_match_the_data(shared_daemon, healthy):
    keys = [BlockKey(os.urandom(16)) for _ in range(2)]
    with raw(shared_daemon) as s:
        meta = P.pack_keys_sizes(keys, [1000, 1000])
        s.sendall(P.pack_header(P.Op.PUT, 0, 2, len(meta), 1500) + meta + b"y" * 1500)
        expect_error(s, ProtocolError, "carries 1500 bytes")
        assert closed(s)
    assert healthy.contains(keys) == [False, False]


def test_commit_of_keys_not_reserved_here(shared_daemon, healthy):
    with raw(shared_daemon) as s:
        meta = P.pack_keys([BlockKey(os.urandom(16))])
        s.sendall(P.pack_header(P.Op.COMMIT, 0, 2, len(meta)) + meta)
        expect_error(s, ProtocolError, "not reserved")


def test_dead_shm_writer_and_reader_release_what_they_held(shared_daemon, healthy):
    key = BlockKey(os.urandom(16))
    with raw(shared_daemon) as s:  # RESERVE and die before COMMIT
        meta = P.pack_keys_sizes([key], [1 << 20])
        s.sendall(P.pack_header(P.Op.RESERVE, 0, 2, len(meta)) + meta)
        h, _ = read_frame(s)
        assert not h.flags & P.FLAG_ERROR
    wait_alone(healthy)
    healthy.put([key], [b"z" * 10])  # the key is free again: the reservation was aborted
    with raw(shared_daemon) as s:  # PIN and die before UNPIN
        meta = P.pack_keys([key])
        s.sendall(P.pack_header(P.Op.PIN, 0, 2, len(meta)) + meta)
        read_frame(s)
    wait_alone(healthy)
    assert healthy.delete([key]) == 1  # a leftover pin would keep it allocated (fixture checks)
    assert healthy.contains([key]) == [False]


def test_first_frame_must_be_hello(shared_daemon, healthy):
    with raw(shared_daemon, authed=False) as s:
        s.sendall(P.pack_header(P.Op.STATS, 0, 1, 0))
        expect_error(s, AuthError, "HELLO")
        assert closed(s)


def test_wrong_or_missing_token(start_daemon):
    d = start_daemon("--auth-token", "s3cret")
    for token in (None, "wrong"):
        with pytest.raises(AuthError, match="auth token"):
            Client(d.address, auth_token=token)
    with Client(d.address, auth_token="s3cret") as c:
        c.put([BlockKey(os.urandom(16))], [b"1"])
    d2 = start_daemon(env={"KVSTORE_AUTH_TOKEN": "from-env"})
    with pytest.raises(AuthError):
        Client(d2.address, auth_token="nope")
    Client(d2.address, auth_token="from-env").close()
