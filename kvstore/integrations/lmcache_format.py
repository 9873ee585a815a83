"""The LMCache plugin's chunk format in the store (``kvstore.integrations.lmcache_plugin``).

Keys. An LMCache ``CacheEngineKey`` (model name, world size, worker id, chunk hash, dtype and
its ``lmcache.tag.*`` tags: every field LMCache compares keys by) maps to the store's 16-byte
key as ``BLAKE2b-128(b"kvstore.lmcache/1\\0" + key.to_string())``: deterministic across
processes and hosts, and chunks of different models, ranks or dtypes never collide.

Values. A stored chunk is a 64-byte header followed by the ``MemoryObj``'s bytes as they are
(little-endian)::

    0   4   magic b"KVL1"
    4   1   MemoryFormat value        5   1   ndim (1..6)
    6   1   dtype code (_DTYPES)      7   1   reserved (0)
    8  24   shape, 6 x u32 (unused dims 0)
   32   8   payload bytes (u64) = prod(shape) * itemsize
   40  16   the store key (the header checks it belongs to the key it came back under)
   56   8   reserved (0)

A header that does not parse, names another key or disagrees with the block's size is not a
chunk (``decode_header`` answers None): the plugin treats it as a miss.
"""
# pyright: reportMissingImports=false

from __future__ import annotations

import hashlib
import struct
from typing import Sequence

import numpy as np
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat

from kvstore.keys import BlockKey

__all__ = ["HEADER", "MAGIC", "store_key", "encode_header", "decode_header"]

_KEY_NS = b"kvstore.lmcache/1\0"
MAGIC = b"KVL1"
HEADER = struct.Struct("<4sBBBB6IQ16s8x")
assert HEADER.size == 64
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
           torch.float8_e4m3fn, torch.float8_e5m2, torch.float64, torch.int32, torch.int64]
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}


def store_key(key: CacheEngineKey) -> BlockKey:
    """The store's 16-byte key of an LMCache key (module docstring)."""
    return BlockKey(hashlib.blake2b(_KEY_NS + key.to_string().encode(), digest_size=16).digest())


def encode_header(skey: bytes, fmt: MemoryFormat, shape: Sequence[int], dtype: torch.dtype) -> bytes:
    if not 1 <= len(shape) <= 6:
        raise ValueError(f"a chunk of {len(shape)} dimensions; 1 to 6 are stored")
    if dtype not in _DTYPE_CODE:
        raise ValueError(f"a chunk of {dtype}; stored dtypes: {_DTYPES}")
    dims = [*shape, *([0] * (6 - len(shape)))]
    nbytes = int(np.prod(shape)) * dtype.itemsize
    return HEADER.pack(MAGIC, fmt.value, len(shape), _DTYPE_CODE[dtype], 0, *dims, nbytes, skey)


def decode_header(head: np.ndarray, skey: bytes, size: int) -> tuple[MemoryFormat, torch.Size, torch.dtype] | None:
    """(fmt, shape, dtype) of a stored chunk of ``size`` bytes whose header is ``head`` (flat
    uint8), or None when it is not one of ``skey``'s or disagrees with the size."""
    if len(head) < HEADER.size:
        return None
    magic, fmt, ndim, code, _, *rest = HEADER.unpack(head[:HEADER.size].tobytes())
    dims, nbytes, echo = rest[:6], rest[6], rest[7]
    if magic != MAGIC or echo != skey or not 1 <= ndim <= 6 or code >= len(_DTYPES):
        return None
    shape, dtype = torch.Size(dims[:ndim]), _DTYPES[code]
    if nbytes != int(np.prod(shape)) * dtype.itemsize or size != HEADER.size + nbytes:
        return None
    try:
        return MemoryFormat(fmt), shape, dtype
    except ValueError:
        return None
