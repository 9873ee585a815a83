"""The block codec: one block's KV, all layers, with a header every reader verifies.

Layout of an encoded block (little-endian), ``HEADER_SIZE`` = 64 bytes then the payload::

    offset size  field
    0      4     magic            b"KVBK"
    4      2     format version   1
    6      1     dtype code       see DTYPES
    7      1     ndim             1..6
    8      16    key              the block's BlockKey
    24     8     checksum         xxh3_64 of the payload
    32     8     payload length   bytes
    40     24    shape            ndim x uint32, zero padded
    64     ...   payload          C-contiguous array, canonical layout
                                  [num_layers, 2, block_size, num_kv_heads, head_dim]

The payload starts 64-byte aligned within the block. Decoding checks magic, version, the
expected key, length and checksum, and raises ``CorruptBlock`` on any mismatch: a corrupt or
misfiled block is a miss, never fed to a model. The codec speaks bytes and dtype names, not
torch, so the store depends on nothing an engine needs.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from kvstore.errors import CorruptBlock
from kvstore.keys import BlockKey

__all__ = [
    "HEADER_SIZE",
    "FORMAT_VERSION",
    "DTYPES",
    "BlockHeader",
    "encoded_size",
    "encode",
    "encode_into",
    "seal",
    "decode",
    "header_template",
]

MAGIC = b"KVBK"
FORMAT_VERSION = 1
HEADER_SIZE = 64
MAX_NDIM = 6
_FIXED = struct.Struct("<4sHBB16sQQ")  # 40 bytes

# dtype name -> (code, itemsize). Names follow torch/numpy spelling without the module.
DTYPES: dict[str, tuple[int, int]] = {
    "float32": (1, 4),
    "float16": (2, 2),
    "bfloat16": (3, 2),
    "float64": (4, 8),
    "uint8": (5, 1),
    "int8": (6, 1),
    "float8_e4m3fn": (7, 1),
    "float8_e5m2": (8, 1),
}
_BY_CODE = {code: name for name, (code, _) in DTYPES.items()}


@dataclass(frozen=True)
class BlockHeader:
    key: BlockKey
    dtype: str
    shape: tuple[int, ...]
    checksum: int
    payload_len: int


def _payload_len(dtype: str, shape: tuple[int, ...]) -> int:
    if dtype not in DTYPES:
        raise ValueError(f"unsupported block dtype {dtype!r}; one of {sorted(DTYPES)}")
    if not 1 <= len(shape) <= MAX_NDIM or any(d < 0 for d in shape):
        raise ValueError(f"block shape must have 1..{MAX_NDIM} non-negative dims, got {shape}")
    n = DTYPES[dtype][1]
    for d in shape:
        n *= d
    return n


def encoded_size(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes an encoded block of this dtype and shape takes (header + payload)."""
    return HEADER_SIZE + _payload_len(dtype, tuple(shape))


def encode_into(out, key: bytes, dtype: str, shape: tuple[int, ...], payload) -> int:
    """Write header + payload into the writable buffer ``out``; return bytes written."""
    shape = tuple(int(d) for d in shape)
    n = _payload_len(dtype, shape)
    src = memoryview(payload).cast("B")
    if src.nbytes != n:
        raise ValueError(f"payload is {src.nbytes} bytes, {dtype}{list(shape)} needs {n}")
    dst = memoryview(out).cast("B")
    if dst.nbytes < HEADER_SIZE + n:
        raise ValueError(f"buffer of {dst.nbytes} bytes is too small for {HEADER_SIZE + n}")
    dst[HEADER_SIZE : HEADER_SIZE + n] = src
    return seal(dst, key, dtype, shape)


def seal(out, key: bytes, dtype: str, shape: tuple[int, ...]) -> int:
    """Write the header of a block whose payload already lies at ``out[HEADER_SIZE:]`` (a
    saver that copies KV straight into its put buffer); return the encoded size."""
    shape = tuple(int(d) for d in shape)
    n = _payload_len(dtype, shape)
    dst = memoryview(out).cast("B")
    if dst.nbytes < HEADER_SIZE + n:
        raise ValueError(f"buffer of {dst.nbytes} bytes is too small for {HEADER_SIZE + n}")
    checksum = xxhash.xxh3_64_intdigest(dst[HEADER_SIZE : HEADER_SIZE + n])
    _FIXED.pack_into(dst, 0, MAGIC, FORMAT_VERSION, DTYPES[dtype][0], len(shape),
                     bytes(BlockKey(key)), checksum, n)
    struct.pack_into(f"<{MAX_NDIM}I", dst, _FIXED.size, *shape, *([0] * (MAX_NDIM - len(shape))))
    return HEADER_SIZE + n


def header_template(dtype: str, shape: tuple[int, ...]) -> bytes:
    """The 64-byte header every block of this dtype and shape has, with a zero key and
    checksum: a verifier compares the rest byte for byte (``kvstore.native.blocks``)."""
    shape = tuple(int(d) for d in shape)
    out = bytearray(HEADER_SIZE)
    _FIXED.pack_into(out, 0, MAGIC, FORMAT_VERSION, DTYPES[dtype][0], len(shape), bytes(16), 0,
                     _payload_len(dtype, shape))
    struct.pack_into(f"<{MAX_NDIM}I", out, _FIXED.size, *shape, *([0] * (MAX_NDIM - len(shape))))
    return bytes(out)


def encode(key: bytes, dtype: str, shape: tuple[int, ...], payload) -> bytearray:
    """A freshly allocated encoded block."""
    out = bytearray(encoded_size(dtype, tuple(shape)))
    encode_into(out, key, dtype, shape, payload)
    return out


def decode(buf, expected_key: bytes | None = None) -> tuple[BlockHeader, memoryview]:
    """Verify an encoded block and return its header and a view of its payload.

    Raises ``CorruptBlock`` when the magic, version, key, length or checksum is wrong.
    """
    view = memoryview(buf).cast("B")
    if view.nbytes < HEADER_SIZE:
        raise CorruptBlock(f"block is {view.nbytes} bytes, shorter than its {HEADER_SIZE}-byte header")
    magic, version, code, ndim, key, checksum, n = _FIXED.unpack_from(view, 0)
    if magic != MAGIC:
        raise CorruptBlock(f"bad block magic {magic!r}; this is not an encoded KV block")
    if version != FORMAT_VERSION:
        raise CorruptBlock(f"block format version {version}, this reader speaks {FORMAT_VERSION}")
    if code not in _BY_CODE or not 1 <= ndim <= MAX_NDIM:
        raise CorruptBlock(f"bad dtype code {code} or ndim {ndim} in block header")
    if expected_key is not None and key != bytes(expected_key):
        raise CorruptBlock(
            f"block is filed under {bytes(expected_key).hex()} but its header says {key.hex()}"
        )
    shape = struct.unpack_from(f"<{ndim}I", view, _FIXED.size)
    dtype = _BY_CODE[code]
    if n != _payload_len(dtype, shape) or view.nbytes < HEADER_SIZE + n:
        raise CorruptBlock(f"block payload length {n} does not match {dtype}{list(shape)} "
                           f"or the {view.nbytes - HEADER_SIZE} bytes present")
    payload = view[HEADER_SIZE : HEADER_SIZE + n]
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        raise CorruptBlock(f"checksum mismatch in block {key.hex()}: its payload is damaged")
    return BlockHeader(BlockKey(key), dtype, tuple(shape), checksum, n), payload
