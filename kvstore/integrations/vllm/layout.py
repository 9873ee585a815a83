"""Where one vLLM block's KV lies in the attention backend's per-layer caches, and its bytes.

vLLM hands the connector one tensor per attention layer (``register_kv_caches``), shaped by
the backend: the CPU backend's ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``,
FlashAttention's ``[2, num_blocks, block_size, num_kv_heads, head_size]``, or a permutation
of either (``vllm.v1.kv_cache_layout``). A block is the same bytes whatever they mean, so the
store keeps them as they lie: the block's **chunks**, for each layer in order and, within a
layer, for each index of the dims before the block dim (FlashAttention's K then V), each the
contiguous run of bytes the block owns there. A block's value is those chunks back to back,
``[num_chunks, chunk_elems]`` of the cache dtype under ``kvstore.codec``'s header; the
namespace names the backend's shapes and strides, so a block is only ever read back into the
same layout (docs/decisions/0055-vllm-native-connector.md).

``BlockLayout`` holds one ``[num_blocks, chunk_bytes]`` uint8 view per chunk. From them it
gives a load's addresses for ``kvstore.client.scatter`` (a CPU cache, written in place),
gathers blocks into host rows for a save, and scatters host rows back into the views (a CUDA
cache's staged load). A scheduler block that the backend splits into several kernel blocks
(its dim is a multiple of the scheduler's ``num_blocks``) is one run all the same.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["BlockLayout", "LayoutError"]


class LayoutError(ValueError):
    """The backend's caches cannot be read block by block as runs of bytes."""


def _layer_order(name: str) -> tuple:
    """Natural order of layer names: ``layers.2`` before ``layers.10``."""
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


@dataclass(frozen=True)
class BlockLayout:
    views: tuple[torch.Tensor, ...]   # per chunk: [num_blocks, chunk_bytes] uint8, rows strided
    chunk_bytes: int
    dtype: torch.dtype
    num_blocks: int
    facts: dict[str, Any]             # what the namespace must know of the layout

    @classmethod
    def from_kv_caches(cls, kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> "BlockLayout":
        """The layout of vLLM's ``register_kv_caches`` tensors, ``num_blocks`` scheduler blocks."""
        if not kv_caches:
            raise LayoutError("no KV cache tensors were registered")
        seen: set[tuple] = set()
        views: list[torch.Tensor] = []
        shapes: list[list[int]] = []
        dtypes = {t.dtype for t in kv_caches.values()}
        if len(dtypes) != 1:
            raise LayoutError(f"layers hold KV of several dtypes {sorted(map(str, dtypes))}")
        for name in sorted(kv_caches, key=_layer_order):
            t = kv_caches[name]
            ident = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
            if ident in seen:  # layers sharing one cache (KV sharing): its bytes once
                continue
            seen.add(ident)
            views.extend(_chunk_views(name, t, num_blocks))
            shapes.append(list(t.shape))
        chunk = views[0].shape[1]
        if any(v.shape[1] != chunk for v in views):
            raise LayoutError("layers' blocks differ in size: " f"{sorted({v.shape[1] for v in views})}")
        dtype = dtypes.pop()
        facts = {"layers": shapes, "chunks": len(views), "chunk_bytes": chunk,
                 "device": views[0].device.type}
        return cls(tuple(views), chunk, dtype, num_blocks, facts)

    @property
    def payload_bytes(self) -> int:
        return len(self.views) * self.chunk_bytes

    @property
    def block_shape(self) -> tuple[int, int]:
        """A block's value shape in the cache dtype: ``(num_chunks, chunk_elems)``."""
        return len(self.views), self.chunk_bytes // self.dtype.itemsize

    @property
    def is_cuda(self) -> bool:
        return self.views[0].is_cuda

    def slots(self, block_ids: Sequence[int]) -> tuple[list[int], list[int], int]:
        """(slots, offsets, chunk) of a load written in place (``kvstore.client.scatter``):
        block ``b``'s slot is its run in the first chunk view; chunk ``c`` lies at the
        signed distance from there to its run in view ``c``."""
        first = self.views[0]
        base, row = first.data_ptr(), first.stride(0)
        slots = [base + int(b) * row for b in block_ids]
        offsets = [v.data_ptr() - base for v in self.views]
        if any(v.stride(0) != row for v in self.views):  # one slot per block must serve all
            raise LayoutError("chunk views differ in block stride; load through host rows")
        return slots, offsets, self.chunk_bytes

    def gather(self, block_ids: Sequence[int], rows: torch.Tensor) -> None:
        """Copy blocks ``block_ids`` into ``rows`` (``[n, payload_bytes]`` uint8, host)."""
        n, c = len(block_ids), self.chunk_bytes
        if self.is_cuda:
            ids = torch.tensor(list(block_ids), dtype=torch.long, device=self.views[0].device)
            for i, v in enumerate(self.views):
                rows[:n, i * c:(i + 1) * c].copy_(v.index_select(0, ids), non_blocking=True)
            torch.cuda.current_stream(self.views[0].device).synchronize()
            return
        for j, b in enumerate(block_ids):
            for i, v in enumerate(self.views):
                rows[j, i * c:(i + 1) * c].copy_(v[int(b)])

    def scatter(self, block_ids: Sequence[int], rows: torch.Tensor) -> None:
        """Copy ``rows`` (``[n, payload_bytes]`` uint8, host) into blocks ``block_ids``."""
        if not block_ids:
            return
        c, dev = self.chunk_bytes, self.views[0].device
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=dev)
        src = rows[:len(block_ids)].to(dev, non_blocking=True)
        for i, v in enumerate(self.views):
            v.index_copy_(0, ids, src[:, i * c:(i + 1) * c])


def _chunk_views(name: str, t: torch.Tensor, num_blocks: int) -> list[torch.Tensor]:
    """One ``[num_blocks, bytes]`` uint8 view for each index of the dims before the block dim."""
    dim = next((d for d, size in enumerate(t.shape) if size >= num_blocks and size % num_blocks == 0), None)
    if dim is None:
        raise LayoutError(f"{name}: no dim of {tuple(t.shape)} counts the {num_blocks} blocks")
    split = t.shape[dim] // num_blocks  # kernel blocks per scheduler block
    lead = t.shape[:dim]
    out = []
    for idx in itertools.product(*(range(s) for s in lead)):
        sub = t[idx]  # [kernel blocks, ...]: one index of the leading dims
        inner = sub[0]
        if not inner.is_contiguous() or (split > 1 and sub.stride(0) != inner.numel()):
            raise LayoutError(f"{name}: a block's bytes in {tuple(t.shape)} with strides "
                              f"{tuple(t.stride())} are not one contiguous run")
        rows = sub.as_strided((num_blocks, split * inner.numel()), (split * sub.stride(0), 1))
        out.append(rows.view(torch.uint8))
    return out
