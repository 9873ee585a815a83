"""The engine's one native kernel: paged decode attention on CPU, built on first use.

``engine/model/csrc/paged_decode.c`` is compiled with the system C compiler (``$CC``, else ``cc``)
into ``$KVCACHE_HOME/native/<digest>/`` (default ``~/.cache/kvcache-store``) the first time
a process asks for it (about a second), keyed by the source, the flags, the compiler and the
CPU, and loaded with ctypes. The library links the ``libgomp.so.1`` that torch already
loaded, so its OpenMP threads are torch's. Nothing is built at import time.

Where no compiler works, or ``KVENGINE_NATIVE=0`` is set, :func:`supports` says False after
one logged warning, and attention falls back to gathering the blocks and calling
``scaled_dot_product_attention`` (same results within float tolerance, slower at large batch).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kvstore.native import build_library, native_home

__all__ = ["paged_decode", "native_status", "build_dir"]

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
# -ffast-math lets GCC call glibc's vectorised expf (libmvec) in the softmax and reassociate the
# dot products; it is given to the compile step only, so crtfastmath.o (which would flip the
# process's denormal flags at load) is never linked in.
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fPIC", "-std=c11"]
_LDFLAGS = ["-shared", "-fopenmp"]

@dataclass
class _Kernel:
    """The process's one attempt to load the kernel: ``fn``, or None and ``why``."""

    tried: bool = False
    fn: Callable[..., int] | None = None
    why: str | None = None


_lock = threading.Lock()
_state = _Kernel()


def build_dir() -> Path:
    """Where built kernels are cached: ``$KVCACHE_HOME/native`` (``kvstore.native.native_home``)."""
    return native_home()


def _load() -> Callable[..., int]:
    if os.environ.get("KVENGINE_NATIVE", "1") == "0":
        raise RuntimeError("disabled by KVENGINE_NATIVE=0")
    lib = build_library(_SOURCE, cflags=_CFLAGS, ldflags=_LDFLAGS)
    fn = lib.paged_decode_f32
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    fn.argtypes = [p, p, p, p, i64, p, p, p, i64, i32, i32, i32, i32, i32, ctypes.c_float, i32]
    fn.restype = i32
    return fn


def _kernel() -> Callable[..., int] | None:
    if not _state.tried:
        with _lock:
            if not _state.tried:
                try:
                    _state.fn = _load()
                except Exception as e:  # noqa: BLE001 - any failure means: use the torch path
                    _state.why = str(e)
                    log.warning("native paged decode unavailable, using the torch path: %s", e)
                _state.tried = True
    return _state.fn


def native_status() -> str:
    """``"native"`` when the kernel is loaded, else ``"torch (<why>)"``; builds on first call."""
    return "native" if _kernel() is not None else f"torch ({_state.why})"


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether :func:`paged_decode` can take these tensors (CPU float32, kernel built)."""
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and k_cache.dtype == torch.float32
        and k_cache.is_contiguous()
        and q.shape[1] // k_cache.shape[2] <= 16
        and q.shape[2] <= 256
        and _kernel() is not None
    )


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention ``[n, heads, head_dim]`` reading K/V from the paged cache in place.

    ``q`` ``[n, heads, head_dim]``; ``k_cache``/``v_cache`` one layer's ``[num_blocks,
    block_size, kv_heads, head_dim]`` (contiguous); ``block_tables`` int32 ``[n, max_blocks]``;
    ``context_lens`` int32 ``[n]`` (keys per sequence, at least 1). Call :func:`supports` first.
    """
    fn = _kernel()
    if fn is None:
        raise RuntimeError(f"native paged decode unavailable: {_state.why}")
    n, heads, hd = q.shape
    _, bs, kvh, _ = k_cache.shape
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32:
        raise TypeError("block_tables and context_lens must be int32")
    if not v_cache.is_contiguous() or v_cache.shape != k_cache.shape:
        raise ValueError("v_cache must be contiguous and shaped like k_cache")
    q = q.contiguous()
    block_tables = block_tables.contiguous()
    max_ctx = block_tables.shape[1] * bs
    threads = torch.get_num_threads()
    scratch = torch.empty(threads, (heads // kvh) * max_ctx, dtype=torch.float32)
    if out is None:
        out = torch.empty(n, heads, hd, dtype=torch.float32)
    elif not out.is_contiguous() or out.shape != q.shape or out.dtype != torch.float32:
        raise ValueError(f"out must be a contiguous float32 {tuple(q.shape)} tensor")
    rc = fn(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
        block_tables.stride(0), context_lens.data_ptr(), out.data_ptr(), scratch.data_ptr(),
        max_ctx, n, heads, kvh, hd, bs, scale, threads,
    )
    if rc != 0:
        raise RuntimeError(f"paged_decode_f32 refused the shapes (code {rc})")
    return out
