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
A list or tuple of ints is hashed in C (``kvstore.native.keys``: the ints read with the C API,
the xxhash wheel's own XXH3-128); anything else, and every machine without a compiler, takes
the Python loop below. Both give the golden vectors' bytes.
"""

from __future__ import annotations

import array
import json
import sys
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


_new_key = bytes.__new__  # BlockKey(x) without the length check, for digests of 16 bytes
_native: list = []  # [the C key function or None], decided on first use


def _native_keys():
    """``kvstore.native.keys.block_keys_fn()``, looked up once (it builds on first use)."""
    if not _native:
        from kvstore.native.keys import block_keys_fn

        _native.append(block_keys_fn())
    return _native[0]
_U32 = next(code for code in "IL" if array.array(code).itemsize == 4)


def _token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """``token_ids`` as little-endian uint32 bytes; ValueError unless flat ints in [0, 2**32).

    A list or tuple goes through ``array.array`` (range-checked in C, about 5x faster than
    ``np.asarray`` on a Python list); anything it refuses takes the NumPy path, which either
    accepts it as before or says what is wrong.
    """
    if (type(token_ids) is list or type(token_ids) is tuple) and not _all_bools(token_ids):
        try:
            arr = array.array(_U32, token_ids)
        except (TypeError, OverflowError):
            pass
        else:
            if sys.byteorder == "big":
                arr.byteswap()
            return arr.tobytes()
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be a flat sequence, got shape {arr.shape}")
    if arr.size and (arr.dtype.kind not in "iu" or arr.min() < 0 or arr.max() > 0xFFFFFFFF):
        raise ValueError("token ids must be integers in [0, 2**32)")
    return arr.astype("<u4", copy=False).tobytes()


def _all_bools(seq: Sequence) -> bool:
    """NumPy reads a list of only bools as dtype bool, which is refused; keep refusing it.
    Stops at the first non-bool, so a real token list costs one check."""
    return bool(seq) and all(type(t) in (bool, np.bool_) for t in seq)


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
    native = _native_keys()
    if native is not None and (type(token_ids) is list or type(token_ids) is tuple):
        if len(keys) > len(token_ids) // block_size:
            raise ValueError(f"{len(keys)} keys given for {len(token_ids) // block_size} full blocks")
        parent = bytes(keys[-1]) if keys else bytes(namespace)
        new_keys = native(parent, token_ids, len(keys) * block_size, block_size, BlockKey)
        if new_keys is not None:  # else an item the Python path must judge (or refuse)
            return [*keys, *new_keys]
    data = _token_bytes(token_ids)
    n_full = len(data) // (4 * block_size)
    out = list(keys)
    if len(out) > n_full:
        raise ValueError(f"{len(out)} keys given for {n_full} full blocks")
    parent = bytes(out[-1]) if out else bytes(namespace)
    # The hot loop: one C call per block on (16-byte parent + token bytes); a digest is
    # 16 bytes, so it becomes a BlockKey without BlockKey.__new__'s check.
    digest, new, append = xxhash.xxh3_128_digest, _new_key, out.append
    stride = 4 * block_size
    for offset in range(len(out) * stride, n_full * stride, stride):
        parent = digest(parent + data[offset : offset + stride])
        append(new(BlockKey, parent))
    return out
