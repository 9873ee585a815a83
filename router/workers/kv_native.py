"""The native table behind :class:`~router.workers.kv_index.KvIndex` (``router/csrc/kv_index.c``).

The C source is a CPython extension module: built on first use by
``kvstore.native.build_library`` (against this interpreter's headers, cached by content in
``$KVCACHE_HOME/native``) and imported from the built file, so its methods are called like any
builtin's (no ctypes marshalling on the hot path). ``table_type()`` is its ``Table`` type, or
None where it cannot be built (no compiler, no ``Python.h``) or ``KVROUTER_NATIVE=0`` is set:
the index then keeps its keys in a Python dict, with the same results.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.util
from pathlib import Path
from typing import Any

from kvstore.native import Library

__all__ = ["LIBRARY", "table_type", "native_status"]

_SOURCE = Path(__file__).resolve().parents[1] / "csrc" / "kv_index.c"
_module: dict[str, Any] = {}


def _import(lib: ctypes.CDLL) -> None:
    """Import the built library as the extension module ``_kv_index`` (PyInit__kv_index)."""
    path = str(getattr(lib, "_name"))
    loader = importlib.machinery.ExtensionFileLoader("_kv_index", path)
    spec = importlib.util.spec_from_file_location("_kv_index", path, loader=loader)
    if spec is None:
        raise RuntimeError(f"cannot import {path} as an extension module")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    table = module.Table()
    table.add([bytes(16)], 1)       # refuse a library that does not behave
    if table.get(bytes(16)) != 1 or len(table) != 1:
        raise RuntimeError("the native table failed its self-check")
    _module["Table"] = module.Table


LIBRARY = Library(_SOURCE, disable_env="KVROUTER_NATIVE", python_api=True, setup=_import,
                  cflags=("-O3", "-march=native", "-fPIC", "-std=gnu11", "-fno-strict-aliasing"))


def table_type() -> Any | None:
    """The native ``Table`` type, or None (see the module docstring). Builds on first call."""
    return _module.get("Table") if LIBRARY.get() is not None else None


def native_status() -> str:
    """``"native"`` or ``"python (<why>)"``."""
    return LIBRARY.status()
