"""The shared-memory index's seqlock (``kvstore/csrc/seqlock.c``), or None where it cannot be built.

- ``get()``: ``kv_seq_get(index, mask, max_probe, key, arena, arena_size, dst, dst_cap,
  out_size, retries) -> status``, a client's lookup and copy out of the arena under a slot's
  seqlock (C11 acquire loads and fences: correct on any CPU).
- ``kv_seq_write(slot, state, key, offset, size)``, the daemon's change of one slot;
  ``kv_seq_set_state(index, state)``, the header's live/closed word.
- ``kv_reader_new(index, mask, max_probe, arena, arena_size, retries)`` / ``kv_reader_free``:
  a reader's constants as one handle; ``kv_read(handle, key, dst, cap) -> int64``:
  ``kv_seq_get``'s answer folded into one integer (``unfold``).
- ``py_library()``: the same source built against this interpreter (``-DKV_PYTHON_API``,
  ``ctypes.PyDLL``) for ``kv_read_obj(handle, key, buffer_object)``: any writable C-contiguous
  buffer object, no pointer taken in Python; calls hold the GIL and copies of 256 KiB or more
  release it. None where it cannot be built (no ``Python.h``): ``kv_read`` then serves.

The layout and the protocol are ``kvstore.node.shared_index``'s (its docstring is the spec),
which also holds the pure-Python path used where this library cannot be built.
``KVSTORE_NATIVE=0`` turns it off.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from kvstore.native.build import CFLAGS, Library

__all__ = ["LIBRARY", "PY_LIBRARY", "library", "py_library", "unfold", "KV_HIT", "KV_MISS",
           "KV_BUSY", "KV_SMALL", "KV_CLOSED", "KV_BADBUF"]

KV_HIT, KV_MISS, KV_BUSY, KV_SMALL, KV_CLOSED = 0, 1, 2, 3, 4
KV_BADBUF = 5  # kv_read_obj: not a writable C-contiguous buffer object

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
    new = lib.kv_reader_new
    new.argtypes = [_p, _u64, _int, _p, _u64, _int]
    new.restype = _p
    lib.kv_reader_free.argtypes = [_p]
    lib.kv_reader_free.restype = None
    rd = lib.kv_read
    rd.argtypes = [_p, ctypes.c_char_p, _p, _u64]
    rd.restype = ctypes.c_int64


def _setup_py(lib: ctypes.CDLL) -> None:
    _setup(lib)
    fn = lib.kv_read_obj
    fn.argtypes = [_p, ctypes.c_char_p, ctypes.py_object]
    fn.restype = ctypes.c_int64


_SOURCE = Path(__file__).resolve().parents[1] / "csrc" / "seqlock.c"
LIBRARY = Library(_SOURCE, setup=_setup)
PY_LIBRARY = Library(_SOURCE, cflags=(*CFLAGS, "-DKV_PYTHON_API"), python_api=True, setup=_setup_py)


def library() -> ctypes.CDLL | None:
    """The loaded library, or None (no compiler, or ``KVSTORE_NATIVE=0``)."""
    return LIBRARY.get()


def py_library() -> ctypes.CDLL | None:
    """The Python-API build (``kv_read_obj``), or None."""
    return PY_LIBRARY.get() if LIBRARY.get() is not None else None


def unfold(v: int) -> tuple[int, int]:
    """``kv_read``'s integer as (status, size)."""
    if v >= 0:
        return KV_HIT, v
    if v <= -16:
        return KV_SMALL, -16 - v
    return -1 - v, 0
