"""Block keys: the chained prefix hash every component uses to name a block of KV.

Spec (golden vectors in ``tests/kvstore/golden_keys.json`` pin the exact bytes):

- A block is ``block_size`` consecutive token ids. Only full blocks get keys.
- ``key[-1]`` is the 16-byte namespace id; ``key[i] = xxh3_128(key[i-1] || tokens_i).digest()``
  where ``tokens_i`` is block ``i``'s token ids as little-endian uint32.
- The namespace id is ``xxh3_128(b"kvstore-namespace-v1\\0" || canonical JSON of the facts)``,
  the facts being everything that changes the KV bytes (model config, weights digest, dtype,
  block size, KV layout, tensor-parallel rank). Canonical JSON: sorted keys, no whitespace,
  UTF-8. A per-request cache salt gives ``salted(ns, salt) = xxh3_128(ns || b"salt\\0" || salt)``,
  so tenants that must not share a cache never do.

Nothing here depends on the process: no Python ``hash()``, no ``PYTHONHASHSEED``. Keys are
computed once per request as its tokens arrive (``extend_block_keys``) and carried with it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import xxhash

__all__ = ["BlockKey", "namespace_id", "salted", "block_keys", "extend_block_keys"]

KEY_BYTES = 16
_NS_DOMAIN = b"kvstore-namespace-v1\0"


class BlockKey(bytes):
    """A 16-byte block key (or namespace id). Immutable, hashable, compares as bytes."""

    __slots__ = ()

    def __new__(cls, value: bytes | bytearray | memoryview) -> "BlockKey":
        value = bytes(value)
        if len(value) != KEY_BYTES:
            raise ValueError(f"a BlockKey is {KEY_BYTES} bytes, got {len(value)}")
        return super().__new__(cls, value)

    @classmethod
    def from_hex(cls, text: str) -> "BlockKey":
        return cls(bytes.fromhex(text))

    def __repr__(self) -> str:
        return f"BlockKey({self.hex()[:12]}…)"


def namespace_id(facts: Mapping[str, Any]) -> BlockKey:
    """The namespace id of a KV layout: xxh3_128 of the canonical JSON of ``facts``."""
    canonical = json.dumps(facts, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return BlockKey(xxhash.xxh3_128(_NS_DOMAIN + canonical.encode("utf-8")).digest())


def salted(namespace: bytes, cache_salt: str | bytes | None) -> BlockKey:
    """The namespace a request with ``cache_salt`` hashes under (itself when no salt)."""
    if not cache_salt:
        return BlockKey(namespace)
    salt = cache_salt.encode("utf-8") if isinstance(cache_salt, str) else bytes(cache_salt)
    return BlockKey(xxhash.xxh3_128(bytes(namespace) + b"salt\0" + salt).digest())


def _token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be a flat sequence, got shape {arr.shape}")
    if arr.size and (arr.dtype.kind not in "iu" or arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise ValueError("token ids must be integers in [0, 2**32)")
    return arr.astype("<u4", copy=False).tobytes()


def block_keys(
    namespace: bytes, token_ids: Sequence[int] | np.ndarray, block_size: int
) -> list[BlockKey]:
    """Keys of every full block of ``token_ids`` (a partial last block gets none)."""
    return extend_block_keys(namespace, [], token_ids, block_size)


def extend_block_keys(
    namespace: bytes,
    keys: Sequence[BlockKey],
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
) -> list[BlockKey]:
    """``keys`` extended to cover every full block of ``token_ids``.

    ``keys`` must be the keys of the first ``len(keys)`` blocks of ``token_ids``; only the
    blocks after them are hashed, so a request's keys are computed once as tokens arrive.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    data = _token_bytes(token_ids)
    n_full = len(data) // (4 * block_size)
    out = list(keys)
    if len(out) > n_full:
        raise ValueError(f"{len(out)} keys given for {n_full} full blocks")
    parent = bytes(out[-1]) if out else bytes(namespace)
    stride = 4 * block_size
    for i in range(len(out), n_full):
        parent = xxhash.xxh3_128(parent + data[i * stride : (i + 1) * stride]).digest()
        out.append(BlockKey(parent))
    return out
