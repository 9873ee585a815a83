"""The shared-memory index's seqlock (``kvstore/csrc/seqlock.c``), or None where it cannot be built.

- ``get()``: ``kv_seq_get(index, mask, max_probe, key, arena, arena_size, dst, dst_cap,
  out_size, retries) -> status``, a client's lookup and copy out of the arena under a slot's
  seqlock (C11 acquire loads and fences: correct on any CPU).
- ``write()``: ``kv_seq_write(slot, state, key, offset, size)``, the daemon's change of one
  slot; ``set_state()``: ``kv_seq_set_state(index, state)``, the header's live/closed word.

The layout and the protocol are ``kvstore.node.shared_index``'s (its docstring is the spec),
which also holds the pure-Python path used where this library cannot be built.
``KVSTORE_NATIVE=0`` turns it off.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from kvstore.native.build import Library

__all__ = ["LIBRARY", "library", "KV_HIT", "KV_MISS", "KV_BUSY", "KV_SMALL", "KV_CLOSED"]

KV_HIT, KV_MISS, KV_BUSY, KV_SMALL, KV_CLOSED = 0, 1, 2, 3, 4

_p, _u64, _int = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int


def _setup(lib: ctypes.CDLL) -> None:
    fn = lib.kv_seq_get
    fn.argtypes = [_p, _u64, _int, ctypes.c_char_p, _p, _u64, _p, _u64, ctypes.POINTER(_u64), _int]
    fn.restype = _int
    w = lib.kv_seq_write
    w.argtypes = [_p, _u64, ctypes.c_char_p, _u64, _u64]
    w.restype = None
    st = lib.kv_seq_set_state
    st.argtypes = [_p, _u64]
    st.restype = None


LIBRARY = Library(Path(__file__).resolve().parents[1] / "csrc" / "seqlock.c", setup=_setup)


def library() -> ctypes.CDLL | None:
    """The loaded library, or None (no compiler, or ``KVSTORE_NATIVE=0``)."""
    return LIBRARY.get()
