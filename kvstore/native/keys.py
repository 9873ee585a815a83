"""Chained block keys in C (``kvstore/csrc/keys_py.c``), for ``kvstore.keys``.

``block_keys_fn()`` is ``fn(parent, tokens, skip, block_size, key_type) -> list | None``: the
keys (of type ``key_type``, a bytes subtype) of every full block of ``tokens`` after the first
``skip`` tokens, chained from ``parent``; None means "the Python path decides" (the C file's
docstring says when). It reads a list's ints with the Python C API (loaded with ctypes.PyDLL,
the GIL held) and hashes with the xxhash wheel's own ``XXH3_128bits``, so its keys are the
Python path's bit for bit (both pinned to ``tests/kvstore/golden_keys.json``). None when no
compiler or no Python headers are found, or ``KVSTORE_NATIVE=0``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvstore.native.build import Library, xxh3_functions

__all__ = ["LIBRARY", "block_keys_fn"]


def _setup(lib: ctypes.CDLL) -> None:
    xxh3_functions()
    fn = lib.kv_block_keys_py
    fn.argtypes = [ctypes.py_object, ctypes.py_object, ctypes.c_ssize_t, ctypes.c_ssize_t,
                   ctypes.py_object, ctypes.c_void_p]
    fn.restype = ctypes.py_object


LIBRARY = Library(Path(__file__).resolve().parents[1] / "csrc" / "keys_py.c", python_api=True,
                  setup=_setup)

_fn: Callable[..., Any] | None = None


def block_keys_fn() -> Callable[..., Any] | None:
    """The native key function (module docstring), or None."""
    global _fn
    if _fn is None:
        lib = LIBRARY.get()
        if lib is None:
            return None
        raw, h128 = lib.kv_block_keys_py, xxh3_functions()["XXH3_128bits"]
        _fn = lambda parent, tokens, skip, bs, key_type: raw(parent, tokens, skip, bs, key_type, h128)  # noqa: E731
    return _fn
