"""The store's block kernels (``kvstore/csrc/blocks.c``), or None where they cannot be built.

- ``verify_scatter()``: the function verifying an encoded block where it lies and copying its
  payload out in chunks (the engine connector's load, ``engine.kv.connector``).
- ``block_keys(parent, token_bytes, n_blocks, block_size)``: ``n_blocks`` chained keys as one
  ``bytes`` of ``16 * n_blocks`` (``kvstore.keys`` slices it into ``BlockKey`` objects).

Both take the xxhash wheel's own XXH3 functions (``kvstore.native.xxh3_functions``), so their
digests are the Python path's bit for bit; golden vectors pin both. ``KVSTORE_NATIVE=0``
turns them off.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from kvstore.native.build import Library, xxh3_functions

__all__ = ["LIBRARY", "verify_scatter", "block_keys", "XXH3_64", "VERIFY_CODES"]

_p, _i64 = ctypes.c_void_p, ctypes.c_int64

# kv_verify_scatter's answers.
VERIFY_CODES = {0: "ok", 1: "header mismatch", 2: "checksum mismatch", 3: "short block"}


def _setup(lib: ctypes.CDLL) -> None:
    xxh3_functions()  # refuse the library now if the wheel exports no XXH3
    fn = lib.kv_verify_scatter
    fn.argtypes = [_p, _i64, ctypes.c_char_p, ctypes.c_char_p, _p, _p, _p, _i64, _i64]
    fn.restype = ctypes.c_int
    keys = lib.kv_block_keys
    keys.argtypes = [ctypes.c_char_p, ctypes.c_char_p, _i64, _i64, _p, _p]
    keys.restype = ctypes.c_int


LIBRARY = Library(Path(__file__).resolve().parents[1] / "csrc" / "blocks.c", setup=_setup)


def verify_scatter():
    """``kv_verify_scatter(block_ptr, block_len, header_template, key, xxh3_64, dst_ptr,
    offsets_ptr, nchunks, chunk_bytes) -> int`` (``VERIFY_CODES``), or None."""
    lib = LIBRARY.get()
    return None if lib is None else lib.kv_verify_scatter


def XXH3_64() -> int:
    """The address of the wheel's ``XXH3_64bits``."""
    return xxh3_functions()["XXH3_64bits"]


_keys_fn = None


def block_keys(parent: bytes, token_bytes: bytes, n_blocks: int, block_size: int) -> bytes | None:
    """``n_blocks`` chained keys after ``parent`` over ``token_bytes`` (little-endian uint32
    token ids, at least ``n_blocks * block_size`` of them) as one ``bytes``; None when the
    library is unavailable or the block is too large for the kernel's stack buffer."""
    global _keys_fn
    if _keys_fn is None:
        lib = LIBRARY.get()
        if lib is None:
            return None
        _keys_fn = (lib.kv_block_keys, xxh3_functions()["XXH3_128bits"])
    fn, h128 = _keys_fn
    out = ctypes.create_string_buffer(16 * n_blocks)
    if fn(parent, token_bytes, n_blocks, block_size, h128, out) != 0:
        return None
    return out.raw
