"""No import cycles between the modules of one package: each package's module graph (every
``import``, also those inside functions and under ``TYPE_CHECKING``, package ``__init__``s
included) has no strongly connected component but the ones listed in ``ALLOWED``, each with
its reason. ``lint-imports`` checks the same between sibling subpackages (pyproject.toml); this
also sees a cycle through a package's ``__init__``, which its contracts do not."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("kvstore", "engine", "router", "planner", "benchmarks", "gpucheck")

# Cycles known and allowed for now (the modules of one component -> why); none today.
ALLOWED: dict[frozenset[str], str] = {}


def _modules(package: str, root: Path = REPO) -> dict[str, tuple[Path, bool]]:
    """Module name -> (its file, whether it is a package's ``__init__``)."""
    mods = {}
    for path in (root / package).rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        mods[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return mods


def _graph(mods: dict[str, tuple[Path, bool]]) -> dict[str, set[str]]:
    """Module -> the modules of ``mods`` it imports (``from P import name``: the module P.name
    if there is one, else P)."""
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, (path, is_pkg) in mods.items():
        here = mod if is_pkg else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in mods:   # ``import a.b.c`` of a name inside a.b
                    target = target.rpartition(".")[0]
                if target and target != mod:
                    graph[mod].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(frozenset(comp))
    return found


def test_the_cycle_finder_finds_a_cycle_through_a_package_init() -> None:
    graph = {"p": {"p.a"}, "p.a": {"p.b"}, "p.b": {"p"}, "p.c": {"p.a"}}
    assert _cycles(graph) == [frozenset({"p", "p.a", "p.b"})]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycle(package: str) -> None:
    graph = _graph(_modules(package))
    cycles = [c for c in _cycles(graph) if c not in ALLOWED]
    described = ["; ".join(f"{a} -> {b}" for a in sorted(c) for b in sorted(graph[a] & c)) for c in cycles]
    assert not cycles, f"import cycles in {package}:\n" + "\n".join(described)


def test_the_graph_sees_imports_inside_functions_and_for_types(tmp_path: Path) -> None:
    # A cycle made of a function-level import or a TYPE_CHECKING one is still a cycle: the
    # shared name belongs in the lower module.
    pkg = tmp_path / "p"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from p.b import B\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from p.a import A\n")
    (pkg / "c.py").write_text("from p import d\n")
    (pkg / "d.py").write_text("def f():\n    from .c import C\n")
    found = set(_cycles(_graph(_modules("p", tmp_path))))
    assert found == {frozenset({"p.a", "p.b"}), frozenset({"p.c", "p.d"})}


def test_every_allowed_cycle_is_still_there() -> None:
    """An allowed cycle that was untied leaves the list too; each one says why it is there."""
    found = {c for p in PACKAGES for c in _cycles(_graph(_modules(p)))}
    assert set(ALLOWED) <= found, f"no longer cycles, remove from ALLOWED: {set(ALLOWED) - found}"
    assert all(reason.strip() for reason in ALLOWED.values()), "every allowed cycle says why"
