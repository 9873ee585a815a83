"""Counters of a BlockStore, per tier; the daemon exports them as Prometheus metrics.

Definitions (every counter only grows; occupancy fields are a snapshot):

- ``hits``/``misses``: lookups by ``pin`` answered / not answered by this tier. A key missing
  from host counts one host miss, then a hit or miss at each lower tier it was looked up in.
- ``bytes_in``: bytes written into the tier (host: commits and promotions; GPU/SSD: demotions).
  ``bytes_out``: bytes read out (host: bytes handed to readers by ``pin``; GPU/SSD: promotions).
- ``evictions``: blocks dropped from the tier with no copy kept below.
  ``demotions``: blocks moved from the tier to the one below. ``promotions``: blocks copied
  into the tier from below. ``corrupt``: records that failed verification (SSD).
- ``used_bytes``: bytes of stored blocks; ``allocated_bytes``: what they (and in-flight
  reservations) take from the allocator; ``capacity_bytes``; ``blocks``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

__all__ = ["TierStats", "StoreStats"]


@dataclass
class TierStats:
    capacity_bytes: int = 0
    used_bytes: int = 0
    allocated_bytes: int = 0
    blocks: int = 0
    hits: int = 0
    misses: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    evictions: int = 0
    demotions: int = 0
    promotions: int = 0
    corrupt: int = 0

    @property
    def occupancy(self) -> float:
        return self.allocated_bytes / self.capacity_bytes if self.capacity_bytes else 0.0


@dataclass
class StoreStats:
    """``gpu``/``ssd`` are None when the tier is not configured."""

    host: TierStats = field(default_factory=TierStats)
    gpu: TierStats | None = None
    ssd: TierStats | None = None
    puts: int = 0  # blocks committed by writers
    put_noops: int = 0  # reserve items answered None (already present or being written)
    store_full: int = 0  # reserve calls that raised StoreFull
    ssd_moved_aside: int = 0  # damaged SSD tiers moved aside at start (ssd_tier.py)

    def copy(self) -> "StoreStats":
        return copy.deepcopy(self)

    def tiers(self) -> dict[str, TierStats]:
        """The configured tiers by name: ``host``, then ``gpu``, ``ssd`` where present."""
        return {name: t for name, t in (("host", self.host), ("gpu", self.gpu), ("ssd", self.ssd))
                if t is not None}
