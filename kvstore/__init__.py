"""kvstore: a tiered KV block store for disaggregated LLM serving.

Usage::

    import kvstore
    from kvstore.keys import namespace_id, block_keys

    ns = namespace_id({"model": "my-model", "dtype": "float32", "block_size": 16})
    keys = block_keys(ns, token_ids, block_size=16)
    with kvstore.connect("127.0.0.1:7700") as store:      # or connect(etcd=..., cluster=...)
        held = store.put(keys, values)                     # batch-first, per-key results
        found = store.get(keys, buffers)                   # into caller-provided buffers
        n = store.prefix_len(keys)                         # longest stored prefix

This package imports neither the engine nor the router.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvstore.errors import AuthError, CorruptBlock, KVStoreError, ProtocolError, StoreFull, StoreUnavailable
from kvstore.keys import BlockKey, block_keys, extend_block_keys, namespace_id, salted

if TYPE_CHECKING:
    from kvstore.client.api import StoreClient, connect
    from kvstore.client.async_client import AsyncClient
    from kvstore.client.node import Client

# The client side is imported when first named, so that ``import kvstore.keys`` (the engine
# core, the router's index) loads the keys and the errors, not sockets and NumPy buffers.
_LAZY = {"AsyncClient": "kvstore.client.async_client", "StoreClient": "kvstore.client.api",
         "connect": "kvstore.client.api", "Client": "kvstore.client.node"}

__all__ = [
    "AsyncClient",
    "AuthError",
    "BlockKey",
    "Client",
    "CorruptBlock",
    "KVStoreError",
    "ProtocolError",
    "StoreClient",
    "StoreFull",
    "StoreUnavailable",
    "block_keys",
    "connect",
    "extend_block_keys",
    "namespace_id",
    "salted",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name == "__version__":  # lazily: most imports never ask (kvstore/version.py)
        from kvstore.version import installed_version

        return installed_version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
