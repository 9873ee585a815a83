import numpy as np
import pytest

from kvstore import CorruptBlock
from kvstore.codec import HEADER_SIZE, decode, encode, encode_into, encoded_size
from kvstore.keys import namespace_id

KEY = namespace_id({"k": 1})
OTHER = namespace_id({"k": 2})


def test_roundtrip_and_alignment():
    arr = np.arange(2 * 2 * 4 * 3 * 8, dtype=np.float32).reshape(2, 2, 4, 3, 8)
    blob = encode(KEY, "float32", arr.shape, arr)
    assert len(blob) == encoded_size("float32", arr.shape) == HEADER_SIZE + arr.nbytes
    header, payload = decode(blob, KEY)
    assert header.key == KEY and header.dtype == "float32" and header.shape == arr.shape
    np.testing.assert_array_equal(np.frombuffer(payload, np.float32).reshape(arr.shape), arr)


def test_bfloat16_is_carried_as_raw_bytes():
    raw = np.arange(16, dtype=np.uint16)
    header, payload = decode(encode(KEY, "bfloat16", (4, 4), raw))
    assert header.dtype == "bfloat16" and bytes(payload) == raw.tobytes()


@pytest.mark.parametrize("damage", ["payload", "magic", "version", "truncate", "length"])
def test_damage_is_detected(damage):
    blob = encode(KEY, "float32", (4,), np.ones(4, np.float32))
    if damage == "payload":
        blob[HEADER_SIZE + 3] ^= 0x01
    elif damage == "magic":
        blob[0] = ord("X")
    elif damage == "version":
        blob[4] = 99
    elif damage == "truncate":
        blob = blob[:-1]
    elif damage == "length":
        blob[32] = 7
    with pytest.raises(CorruptBlock):
        decode(blob, KEY)


def test_misfiled_block_is_corrupt():
    blob = encode(KEY, "float32", (4,), np.ones(4, np.float32))
    with pytest.raises(CorruptBlock, match="filed under"):
        decode(blob, OTHER)


def test_encode_validates():
    with pytest.raises(ValueError, match="needs"):
        encode(KEY, "float32", (4,), np.ones(3, np.float32))
    with pytest.raises(ValueError, match="unsupported"):
        encode(KEY, "complex64", (4,), b"")
    with pytest.raises(ValueError, match="too small"):
        encode_into(bytearray(10), KEY, "uint8", (4,), b"abcd")
