"""Rendezvous (highest-random-weight) placement of block keys on store nodes.

Spec: node ``n``'s weight for key ``k`` is ``xxh3_64(utf8(n) || k)`` as an unsigned integer;
a key's owners are the nodes in decreasing weight order (ties, which need a 64-bit
collision, break by node id). The first ``r`` are its replicas; the rest are the fallbacks
a client tries, in order, when an owner cannot be reached.

Properties every client relies on (tests show each):

- deterministic across processes and machines (no Python ``hash()``, no seeds);
- balanced: each of ``n`` nodes owns about ``1/n`` of the keys;
- minimal movement: adding a node moves only the keys it now owns (about ``1/(n+1)``);
  removing one moves only the keys it owned, and each moves to its next-ranked node.

Computing placement is local (every client watches the same member list); nothing per block
is written to etcd.

``View`` is one moment's placement as a cluster sees it: the live nodes, those of them that
are draining, and R (``kvstore.coord.settings``). A key's *targets* (where it is written and
kept) are the first R nodes of its ranking that are not draining; its *read order* is the
whole ranking, draining nodes included (they still serve what they hold until they leave).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

from xxhash import xxh3_64_intdigest

__all__ = ["owners", "ranking", "Placement", "View"]


def _weights(key: bytes, encoded: Sequence[tuple[bytes, str]]) -> list[tuple[int, str]]:
    return [(xxh3_64_intdigest(nb + key), node) for nb, node in encoded]


def ranking(key: bytes, node_ids: Iterable[str]) -> list[str]:
    """Every node in ``node_ids``, highest weight for ``key`` first."""
    return Placement(node_ids).ranking(key)


def owners(key: bytes, node_ids: Iterable[str], r: int = 1) -> list[str]:
    """The ``r`` owners of ``key`` among ``node_ids`` (fewer if there are fewer nodes)."""
    return Placement(node_ids).owners(key, r)


class Placement:
    """Rendezvous placement over one fixed set of node ids (encode them once, place many keys).

    Immutable; build a new one when membership changes.
    """

    __slots__ = ("node_ids", "_encoded")

    def __init__(self, node_ids: Iterable[str]) -> None:
        self.node_ids: tuple[str, ...] = tuple(sorted(set(node_ids)))
        self._encoded = tuple((n.encode("utf-8"), n) for n in self.node_ids)

    def __len__(self) -> int:
        return len(self.node_ids)

    def owners(self, key: bytes, r: int = 1) -> list[str]:
        """The ``r`` highest-weight nodes for ``key``."""
        if r < 1:
            raise ValueError(f"r must be >= 1, got {r}")
        if r == 1:
            if not self._encoded:
                return []
            key = bytes(key)
            best = max(_weights(key, self._encoded))  # tuples: weight, then node id
            return [best[1]]
        return self.ranking(key)[:r]

    def ranking(self, key: bytes) -> list[str]:
        """All nodes, highest weight for ``key`` first."""
        scored = _weights(bytes(key), self._encoded)
        scored.sort(reverse=True)
        return [node for _, node in scored]


@dataclass(frozen=True)
class View:
    """Placement plus the draining nodes and R (module docstring). Immutable."""

    placement: Placement = field(default_factory=lambda: Placement(()))
    draining: frozenset[str] = frozenset()
    replicas: int = 1

    def targets(self, key: bytes, exclude: Collection[str] = ()) -> list[str]:
        """The first R nodes of ``key``'s ranking that are neither draining nor excluded."""
        out: list[str] = []
        for node in self.placement.ranking(key):
            if node not in self.draining and node not in exclude:
                out.append(node)
                if len(out) == self.replicas:
                    break
        return out
