"""Buffer adapters: what the client accepts as a value to put or a buffer to get into.

Anything with the buffer protocol (bytes, bytearray, memoryview, NumPy arrays) and torch
tensors: a CPU tensor is used in place through a flat uint8 view; a CUDA tensor goes through
a CPU staging copy (pinned memory for a get, ``.cpu()`` for a put). Tensors are recognized
by duck typing (``.is_cuda``), so torch is imported only when a tensor is passed.

A get's buffer must be C-contiguous, writable and at least as large as the block; the block
fills its head. Every adapter yields a flat ``np.uint8`` array, which is what the data paths
copy to and from (``np.copyto`` from the mapped arena, ``recv_into`` from a socket).
"""

from __future__ import annotations

import numpy as np

__all__ = ["source_bytes", "Dest"]


def _tensor_bytes(t) -> np.ndarray:
    import torch

    if not t.is_contiguous():
        raise ValueError("tensor buffers must be contiguous; call .contiguous() first")
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def source_bytes(value) -> np.ndarray:
    """A read-only flat uint8 view of a value to put (CUDA tensors are staged to CPU)."""
    if hasattr(value, "is_cuda"):
        t = value.detach()
        return _tensor_bytes(t.cpu() if t.is_cuda else t.contiguous())
    if isinstance(value, np.ndarray):
        return np.ascontiguousarray(value).reshape(-1).view(np.uint8)
    try:
        return np.frombuffer(memoryview(value).cast("B"), np.uint8)
    except TypeError:
        raise ValueError(f"cannot put a {type(value).__name__}: pass bytes-like, a NumPy array "
                         "or a torch tensor (C-contiguous)") from None


class Dest:
    """A writable flat uint8 view (``array``) of a get buffer; a CUDA tensor gets a pinned
    CPU staging buffer that ``finish(nbytes)`` copies to the device."""

    __slots__ = ("array", "_cuda")

    def __init__(self, buf) -> None:
        self._cuda = None
        if hasattr(buf, "is_cuda"):
            if buf.is_cuda:
                import torch

                if not buf.is_contiguous():
                    raise ValueError("tensor buffers must be contiguous")
                self._cuda = buf
                self.array = torch.empty(buf.nbytes, dtype=torch.uint8, pin_memory=True).numpy()
            else:
                self.array = _tensor_bytes(buf)
        elif isinstance(buf, np.ndarray):
            if not buf.flags.c_contiguous or not buf.flags.writeable:
                raise ValueError("NumPy get buffers must be C-contiguous and writable")
            self.array = buf.reshape(-1).view(np.uint8)
        else:
            try:
                mv = memoryview(buf).cast("B")
            except TypeError:
                raise ValueError(f"cannot get into a {type(buf).__name__}: pass a writable "
                                 "bytes-like object, NumPy array or torch tensor") from None
            if mv.readonly:
                raise ValueError(f"get buffer of type {type(buf).__name__} is read-only")
            self.array = np.frombuffer(mv, np.uint8)

    @property
    def staged(self) -> bool:
        """True when ``finish`` must run after the bytes land (a CUDA tensor)."""
        return self._cuda is not None

    def finish(self, nbytes: int) -> None:
        if self._cuda is not None:
            import torch

            flat = self._cuda.reshape(-1).view(torch.uint8)
            flat[:nbytes].copy_(torch.from_numpy(self.array[:nbytes]), non_blocking=False)
