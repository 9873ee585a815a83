"""kvstore's import graph as grimp sees it (static imports, lazy and TYPE_CHECKING ones
included): no path from the client side to torch. (No import cycles is an import-linter
contract in pyproject.toml, checked by tests/test_architecture.py.)"""

from __future__ import annotations

import grimp

# Modules allowed to import torch: the optional CUDA tier, which only a daemon loads, the
# LMCache plugin, which only LMCache loads (its MemoryObjs are torch tensors), the vLLM
# connector's modules that touch vLLM's caches, which only vLLM loads, and kvstore.transfer,
# the loads and staging buffers that only engines' connectors (ours, vLLM's) load.
_TORCH_USERS = {"kvstore.node.gpu_tier", "kvstore.integrations.lmcache_plugin",
                "kvstore.integrations.lmcache_format", "kvstore.integrations.vllm.layout",
                "kvstore.integrations.vllm.transfers", "kvstore.integrations.vllm.connector",
                "kvstore.transfer.loader", "kvstore.transfer.staging"}


def test_only_the_gpu_tier_imports_torch() -> None:
    # The router imports kvstore's client; torch must not come with it (buffers.py's docstring).
    graph = grimp.build_graph("kvstore", include_external_packages=True, cache_dir=None)
    users = {m for m in graph.find_modules_that_directly_import("torch") if m.startswith("kvstore")}
    assert users <= _TORCH_USERS
    for source in ("kvstore", "kvstore.client.api", "kvstore.client.cluster",
                   "kvstore.client.async_client", "kvstore.coord.registration"):
        assert graph.find_shortest_chain(importer=source, imported="torch") is None, source
