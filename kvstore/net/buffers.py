"""Buffer adapters: what the client accepts as a value to put or a buffer to get into.

Anything with the buffer protocol (bytes, bytearray, memoryview, NumPy arrays) and torch
tensors: a CPU tensor is used in place through a flat uint8 view; a CUDA tensor goes through
a CPU staging copy (pinned memory for a get, ``.cpu()`` for a put).

This module never imports torch (a process that never loads it, such as the router, does
not get it through the store client): a value can only be a tensor if torch is already
loaded, so a tensor is ``isinstance(value, sys.modules["torch"].Tensor)``, and the torch
functions the adapters need are reached through the tensor's own module.

A value to put may also be ``Parts(a, b, ...)``: several buffers stored as one block, their
bytes concatenated, with no copy to join them first (a header beside a payload that lives
elsewhere, as the LMCache plugin stores LMCache's own memory).

A get's buffer must be C-contiguous, writable and at least as large as the block; the block
fills its head. Every adapter yields a flat ``np.uint8`` array, which is what the data paths
copy to and from (``np.copyto`` from the mapped arena, ``recv_into`` from a socket).
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["source_bytes", "source_parts", "Parts", "Dest", "Sink"]


def _torch_of(value: object) -> ModuleType | None:
    """The torch module if ``value`` is a torch tensor, else None (torch is never imported)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return torch
    return None


def _tensor_bytes(torch: Any, t: Any) -> np.ndarray:
    if not t.is_contiguous():
        raise ValueError("tensor buffers must be contiguous; call .contiguous() first")
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def source_bytes(value: Any) -> np.ndarray:
    """A read-only flat uint8 view of a value to put (CUDA tensors are staged to CPU)."""
    if (torch := _torch_of(value)) is not None:
        t = value.detach()
        return _tensor_bytes(torch, t.cpu() if t.is_cuda else t.contiguous())
    if isinstance(value, np.ndarray):
        return np.ascontiguousarray(value).reshape(-1).view(np.uint8)
    try:
        return np.frombuffer(memoryview(value).cast("B"), np.uint8)
    except TypeError:
        raise ValueError(f"cannot put a {type(value).__name__}: pass bytes-like, a NumPy array "
                         "or a torch tensor (C-contiguous)") from None


class Parts(tuple):
    """A value to put made of several buffers, stored as one block (their concatenation)."""

    __slots__ = ()

    def __new__(cls, *parts: Any) -> "Parts":
        return super().__new__(cls, parts)


def source_parts(value: Any) -> list[np.ndarray]:
    """``source_bytes`` of each part of a ``Parts`` value, or of the one value."""
    if isinstance(value, Parts):
        return [source_bytes(p) for p in value]
    return [source_bytes(value)]


class Sink:
    """A get destination that consumes each block where it lies instead of receiving a copy.

    On the shared-memory path ``consume(block)`` is called with the block's bytes in the
    daemon's arena, pinned for the duration of the call (no copy precedes it); over TCP the
    block is first received into ``staging`` (a writable flat uint8 array at least as large as
    the block, which the sink may reuse across gets) and ``consume(staging[:size])`` follows
    at once, while those bytes are still in cache. ``consume`` must not keep the view, and
    should not raise: a sink records its own failures (the engine's connector verifies and
    scatters a KV block into its paged cache this way, ``engine.kv.connector``). On shared
    memory the client hands a get's sinks their blocks in one ``consume_all`` call.

    Over TCP a sink may instead name where a block's bytes land once their size is known
    (``landing``): the bytes are received straight there and ``landed`` follows, with no
    staging copy (the LMCache plugin receives a chunk's header into a small array and its
    payload into LMCache's own memory this way).
    """

    __slots__ = ("staging",)

    def __init__(self, staging: np.ndarray) -> None:
        self.staging = staging

    def consume(self, block: np.ndarray) -> None:
        raise NotImplementedError

    def landing(self, size: int) -> list[np.ndarray] | None:
        """Over TCP: writable flat uint8 arrays whose sizes sum to ``size`` that the block is
        received into, in order, then ``landed(size)``; None (the default): receive into
        ``staging`` and ``consume``."""
        return None

    def landed(self, size: int) -> None:
        """The block's bytes are in the arrays ``landing`` returned."""
        raise NotImplementedError

    @classmethod
    def consume_all(cls, work: list[tuple["Sink", np.ndarray]]) -> None:
        """Consume several blocks of one get (the shared-memory path calls it once, with every
        block pinned until it returns; ``work`` is in key order, its sinks all of this class).
        The default consumes them one after another; a subclass may spread them over threads,
        but must have consumed every one when it returns."""
        for sink, block in work:
            sink.consume(block)


class Dest:
    """A writable flat uint8 view (``array``) of a get buffer; a CUDA tensor gets a pinned
    CPU staging buffer that ``finish(nbytes)`` copies to the device; a ``Sink`` receives into
    its staging array and ``finish`` hands it the bytes (``sink`` is set: the shared-memory
    path gives it the arena's bytes instead)."""

    __slots__ = ("array", "sink", "_cuda", "_torch")

    def __init__(self, buf: Any) -> None:
        self._cuda: Any = None
        self.sink: Sink | None = None
        self._torch = torch = _torch_of(buf)
        self.array: np.ndarray
        if isinstance(buf, Sink):
            self.sink = buf
            self.array = buf.staging
        elif torch is not None:
            if buf.is_cuda:
                if not buf.is_contiguous():
                    raise ValueError("tensor buffers must be contiguous")
                self._cuda = buf
                self.array = torch.empty(buf.nbytes, dtype=torch.uint8, pin_memory=True).numpy()
            else:
                self.array = _tensor_bytes(torch, buf)
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
        """True when ``finish`` must run after the bytes land (a CUDA tensor, a sink)."""
        return self._cuda is not None or self.sink is not None

    def finish(self, nbytes: int) -> None:
        if self.sink is not None:
            self.sink.consume(self.array[:nbytes])
        elif self._cuda is not None:
            torch: Any = self._torch
            flat = self._cuda.reshape(-1).view(torch.uint8)
            flat[:nbytes].copy_(torch.from_numpy(self.array[:nbytes]), non_blocking=False)
