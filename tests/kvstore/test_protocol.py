"""Unit tests of the wire format (kvstore/net/protocol.py) and the daemon config; no processes."""

import socket
import threading

import numpy as np
import pytest

from kvstore import AuthError, CorruptBlock, KVStoreError, ProtocolError, StoreFull, StoreUnavailable
from kvstore.daemon.config import ServerConfig, parse_size
from kvstore.keys import BlockKey
from kvstore.net import protocol as P
from kvstore.net import sockio

KEYS = [BlockKey(bytes([i]) * 16) for i in range(5)]


def test_header_roundtrip_and_size():
    raw = P.pack_header(P.Op.GET, P.FLAG_RESPONSE, 2**63 + 5, 1234, 2**33)
    assert len(raw) == P.HEADER_SIZE == 32
    h = P.unpack_header(raw)
    assert (h.op, h.flags, h.request_id, h.meta_len, h.data_len) == (
        P.Op.GET, P.FLAG_RESPONSE, 2**63 + 5, 1234, 2**33)


@pytest.mark.parametrize("field,value,match", [
    ("magic", b"HTTP", "magic"),
    ("version", 2, "version"),
    ("meta", P.MAX_META + 1, "meta"),
    ("data", P.MAX_DATA + 1, "data"),
])
def test_bad_headers_are_protocol_errors(field, value, match):
    parts = dict(magic=P.MAGIC, version=P.VERSION, meta=0, data=0)
    parts[field] = value
    raw = P.HEADER.pack(parts["magic"], parts["version"], 1, 0, 1, parts["meta"], 0, parts["data"])
    with pytest.raises(ProtocolError, match=match):
        P.unpack_header(raw)


def test_keys_and_sizes_roundtrip():
    sizes = [1, 368_704, 2**40, 7, 65536]
    keys, got = P.unpack_keys_sizes(P.pack_keys_sizes(KEYS, sizes))
    assert keys == KEYS and got == sizes and all(isinstance(k, BlockKey) for k in keys)
    assert P.unpack_keys(P.pack_keys(KEYS)) == KEYS
    assert P.unpack_keys(P.pack_keys([])) == []


def test_malformed_key_meta():
    meta = P.pack_keys(KEYS)
    with pytest.raises(ProtocolError, match="does not hold"):
        P.unpack_keys(meta[:-1])
    with pytest.raises(ProtocolError, match="too short"):
        P.unpack_keys(b"\x01")
    with pytest.raises(ProtocolError, match="0 bytes"):
        P.unpack_keys_sizes(P.pack_keys_sizes(KEYS[:2], [5, 0]))
    with pytest.raises(ProtocolError, match="limit"):
        P.unpack_keys(P._U32.pack(P.MAX_BATCH + 1))


@pytest.mark.parametrize("exc", [ProtocolError, AuthError, StoreFull, CorruptBlock, StoreUnavailable])
def test_error_frames_map_back_to_typed_exceptions(exc):
    code = P.error_code_for(exc("boom"))
    back = P.error_from_meta(P.pack_error(code, "boom ✓"))
    assert type(back) is exc and str(back) == "boom ✓"


def test_unknown_errors_are_internal_kvstore_errors():
    assert P.error_code_for(RuntimeError("x")) == P.ErrorCode.INTERNAL
    back = P.error_from_meta(P.pack_error(P.ErrorCode.INTERNAL, "bug"))
    assert type(back) is KVStoreError
    assert type(P.error_from_meta(b"\x99\x00what")) is KVStoreError


def test_send_buffers_handles_many_buffers_and_partial_sends():
    a, b = socket.socketpair()
    rng = np.random.default_rng(0)
    bufs = [rng.integers(0, 255, int(n), dtype=np.uint8)
            for n in rng.integers(1, 3000, 1500)] + [rng.integers(0, 255, 3 << 20, dtype=np.uint8)]
    bufs.insert(3, b"")  # empty buffers are skipped
    total = sum(len(x) for x in bufs)
    got = bytearray(total)
    reader = threading.Thread(target=sockio.recv_exact, args=(b, memoryview(got)))
    reader.start()
    sockio.send_buffers(a, bufs)
    reader.join(10)
    assert bytes(got) == b"".join(bytes(x) for x in bufs)
    a.close()
    with pytest.raises(ConnectionError):
        sockio.recv_exact(b, memoryview(bytearray(1)))
    b.close()


def test_parse_size_and_config_validation():
    assert parse_size("512M") == 512 << 20
    assert parse_size("4G") == 4 << 30
    assert parse_size("1.5GiB") == 3 << 29
    assert parse_size("360K") == 360 << 10
    assert parse_size("65536") == 65536
    with pytest.raises(ValueError, match="size"):
        parse_size("lots")
    with pytest.raises(ValueError, match="--memory"):
        ServerConfig(memory_bytes=0)
    with pytest.raises(ValueError, match="--ssd-path"):
        ServerConfig(memory_bytes=1 << 20, ssd_capacity_bytes=1 << 30)
    with pytest.raises(ValueError, match="--cluster"):
        ServerConfig(memory_bytes=1 << 20, cluster="a/b")
