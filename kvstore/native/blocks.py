"""The connector's block kernel (``kvstore/csrc/blocks.c``), or None where it cannot be built.

``verify_scatter()`` is ``kv_verify_scatter(block_ptr, block_len, header_template, key,
xxh3_64, dst_ptr, offsets_ptr, nchunks, chunk_bytes) -> int`` (``VERIFY_CODES``): it verifies
an encoded block where it lies (header against the template with the block's key, XXH3-64 of
the payload against the header's checksum) and only then copies the payload out in chunks,
chunk ``c`` to ``dst + offsets[c]``. Called through ctypes.CDLL: the GIL is released.
``KVSTORE_NATIVE=0`` turns it off.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from kvstore.native.build import Library, xxh3_functions

__all__ = ["LIBRARY", "verify_scatter", "xxh3_64", "VERIFY_CODES"]

_p, _i64 = ctypes.c_void_p, ctypes.c_int64

VERIFY_CODES = {0: "ok", 1: "header mismatch", 2: "checksum mismatch", 3: "short block"}


def _setup(lib: ctypes.CDLL) -> None:
    xxh3_functions()  # refuse the library now if the wheel exports no XXH3
    fn = lib.kv_verify_scatter
    fn.argtypes = [_p, _i64, ctypes.c_char_p, ctypes.c_char_p, _p, _p, _p, _i64, _i64]
    fn.restype = ctypes.c_int


LIBRARY = Library(Path(__file__).resolve().parents[1] / "csrc" / "blocks.c", setup=_setup)


def verify_scatter():
    """The kernel (module docstring), or None when it cannot be built."""
    lib = LIBRARY.get()
    return None if lib is None else lib.kv_verify_scatter


def xxh3_64() -> int:
    """The address of the xxhash wheel's ``XXH3_64bits``."""
    return xxh3_functions()["XXH3_64bits"]
