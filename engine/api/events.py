"""Event-stream and snapshot types of the worker HTTP API (torch-free; shared with the router).

Wire conventions as in ``engine.api.generate`` (``to_json``/``from_json``, hex block keys,
:class:`~engine.api.fields.ApiValidationError` naming the offending field).

- ``GET /events?since=SEQ``: NDJSON :class:`BlockEvent` / :class:`LoadEvent` lines, numbered by
  one sequence shared by both kinds (:func:`parse_event`). A reader that sees a gap resyncs from
  ``GET /snapshot`` = :class:`Snapshot`.
- :class:`LoadFigures`: a worker's load, in load events and snapshots.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from engine.api.fields import json_object, read_figures, read_int, read_keys, read_str
from kvstore.keys import BlockKey

__all__ = ["LoadFigures", "BlockEvent", "LoadEvent", "WorkerEvent", "parse_event", "Snapshot"]


@dataclass(frozen=True, slots=True)
class LoadFigures:
    """A worker's load. Rates are the worker's recent measurements; 0.0 means "not measured
    yet" (no prefill, store load or decode has happened), not "infinitely slow"."""

    waiting: int = 0
    running: int = 0
    kv_free_blocks: int = 0
    kv_total_blocks: int = 0
    prefill_tokens_per_s: float = 0.0
    load_tokens_per_s: float = 0.0
    decode_tokens_per_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Any, where: str = "load.") -> LoadFigures:
        return cls(**read_figures(cls, json_object(obj, where.rstrip(".")), where))


@dataclass(frozen=True, slots=True)
class BlockEvent:
    """Blocks entered (``stored``) or left (``removed``) the worker's device cache."""

    seq: int
    type: Literal["stored", "removed"]
    keys: tuple[BlockKey, ...]

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "type": self.type, "keys": [k.hex() for k in self.keys]}


@dataclass(frozen=True, slots=True)
class LoadEvent:
    """A load report; it takes a sequence number like the block events."""

    seq: int
    load: LoadFigures

    type: Literal["load"] = "load"

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "type": "load", **self.load.to_json()}


WorkerEvent = BlockEvent | LoadEvent


def parse_event(obj: Any) -> WorkerEvent:
    """One decoded NDJSON line of ``GET /events``."""
    obj = json_object(obj, "event")
    seq = read_int(obj, "seq", lo=0)
    kind = read_str(obj, "type", choices=("stored", "removed", "load"))
    if kind == "load":
        return LoadEvent(seq, LoadFigures.from_json(obj, where=""))
    return BlockEvent(seq, kind, tuple(read_keys(obj, "keys")))


@dataclass(frozen=True, slots=True)
class Snapshot:
    """``GET /snapshot``: every block in the device cache and the load as of event ``seq``;
    the events that follow it start at ``seq + 1``."""

    seq: int
    blocks: tuple[BlockKey, ...]
    load: LoadFigures

    def to_json(self) -> dict[str, Any]:
        return {"seq": self.seq, "blocks": [k.hex() for k in self.blocks], "load": self.load.to_json()}

    @classmethod
    def from_json(cls, obj: Any) -> Snapshot:
        obj = json_object(obj, "snapshot")
        return cls(read_int(obj, "seq", lo=0), tuple(read_keys(obj, "blocks")),
                   LoadFigures.from_json(obj.get("load", {})))
