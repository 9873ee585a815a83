"""The kvstore package's import graph (static imports, lazy and TYPE_CHECKING ones included,
as grimp sees them): no circles, and no path from the client side to torch."""

from __future__ import annotations

import grimp

# Modules allowed to import torch: the optional CUDA tier, which only the daemon loads.
_TORCH_USERS = {"kvstore.node.gpu_tier"}


def _graph() -> grimp.ImportGraph:
    return grimp.build_graph("kvstore", include_external_packages=True, cache_dir=None)


def _cycles(graph: grimp.ImportGraph, modules: set[str]) -> list[list[str]]:
    """Strongly connected components of more than one module (or a self-import), Tarjan."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(m: str) -> None:
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for n in graph.find_modules_directly_imported_by(m) & modules:
            if n not in index:
                visit(n)
                low[m] = min(low[m], low[n])
            elif n in on_stack:
                low[m] = min(low[m], index[n])
        if low[m] == index[m]:
            comp = []
            while True:
                n = stack.pop()
                on_stack.discard(n)
                comp.append(n)
                if n == m:
                    break
            if len(comp) > 1 or m in graph.find_modules_directly_imported_by(m):
                out.append(sorted(comp))

    for m in sorted(modules):
        if m not in index:
            visit(m)
    return out


def test_cycle_finder_finds_a_cycle() -> None:
    g = grimp.ImportGraph()
    for m in ("a", "a.x", "a.y", "a.z"):
        g.add_module(m)
    g.add_import(importer="a.x", imported="a.y")
    g.add_import(importer="a.y", imported="a.z")
    g.add_import(importer="a.z", imported="a.x")
    assert _cycles(g, {"a.x", "a.y", "a.z"}) == [["a.x", "a.y", "a.z"]]


def test_kvstore_has_no_import_cycles() -> None:
    graph = _graph()
    modules = {m for m in graph.modules if m == "kvstore" or m.startswith("kvstore.")}
    assert _cycles(graph, modules) == []


def test_only_the_gpu_tier_imports_torch() -> None:
    # The router imports kvstore's client; torch must not come with it (pyproject's
    # import contracts, and buffers.py's docstring).
    graph = _graph()
    users = {m for m in graph.find_modules_that_directly_import("torch") if m.startswith("kvstore")}
    assert users <= _TORCH_USERS
    for source in ("kvstore", "kvstore.client.api", "kvstore.client.cluster", "kvstore.coord.registration"):
        assert graph.find_shortest_chain(importer=source, imported="torch") is None, source
