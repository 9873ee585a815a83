"""What the scheduler side tells the worker side each step (inside vLLM's connector metadata),
and the block keys both compute.

Keys: our chained XXH3 keys (``kvstore.keys``) over the request's prompt token ids at vLLM's
block size, under the instance's namespace (``namespace_facts``) salted with the request's
``cache_salt`` and LoRA adapter (``request_namespace``). Never vLLM's own block hash, which
depends on its hash function, ``PYTHONHASHSEED`` and version. With tensor parallelism each
rank's KV is its own block: rank ``r``'s key is ``xxh3_128(key || b"tp-rank\\0" || r)``
(``for_rank``; rank keys of a TP size of 1 are the keys themselves).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from kvstore.keys import BlockKey, salted

__all__ = ["LoadSpec", "SaveSpec", "for_rank", "request_namespace"]


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Load ``keys`` into blocks ``block_ids``; ``wait_s`` > 0: a decode after a prefill
    elsewhere waits up to that long for the blocks to be stored first."""

    req_id: str
    keys: tuple[BlockKey, ...]
    block_ids: tuple[int, ...]
    wait_s: float = 0.0


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Save blocks ``block_ids`` (computed by this step) under ``keys``."""

    req_id: str
    keys: tuple[BlockKey, ...]
    block_ids: tuple[int, ...]


def for_rank(keys: Sequence[BlockKey], rank: int, size: int) -> list[BlockKey]:
    """The keys of tensor-parallel rank ``rank``'s share of each block (module docstring)."""
    if size == 1:
        return list(keys)
    tag = b"tp-rank\0" + struct.pack("<I", rank)
    return [BlockKey(xxhash.xxh3_128_digest(bytes(k) + tag)) for k in keys]


def request_namespace(namespace: bytes, cache_salt: str | None, lora: Any) -> BlockKey:
    """The namespace a request hashes under: salted by its ``cache_salt`` and its LoRA
    adapter's name and path (a request without either: the instance's own)."""
    ns = salted(namespace, cache_salt)
    if lora is not None:
        name = getattr(lora, "lora_name", "") or ""
        path = getattr(lora, "lora_path", "") or ""
        ns = salted(ns, f"lora\0{name}\0{path}")
    return ns
