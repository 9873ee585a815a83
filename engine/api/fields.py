"""Field readers of the worker-API types (torch-free; shared with the router).

Every ``from_json`` in ``engine.api.generate`` and ``engine.api.events`` reads its fields with
these: each checks a field's type and range and raises :class:`ApiValidationError` naming the
field (a dotted path: ``where`` is the prefix, e.g. ``"sampling."``). A default of ``...``
means the field is required; a default of ``None`` lets the field be absent or null.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any, Literal, overload

from kvstore.keys import BlockKey

__all__ = [
    "ApiValidationError", "json_object", "read_object", "read_int", "read_float", "read_bool",
    "read_str", "is_token_ids", "read_token_ids", "read_keys", "read_figures",
]


class ApiValidationError(ValueError):
    """A worker-API message is malformed. ``field`` names the offending field (dotted path)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def json_object(obj: Any, name: str) -> Mapping[str, Any]:
    if not isinstance(obj, Mapping):
        raise ApiValidationError(name, f"expected a JSON object, got {type(obj).__name__}")
    return obj


def read_object(obj: Mapping[str, Any], key: str, default: Any = ..., where: str = "") -> Any:
    """A nested JSON object (a ``Mapping``); ``default`` when absent (``None`` allowed)."""
    value = obj.get(key, default)
    if value is ...:
        raise ApiValidationError(where + key, "is required")
    if value is None and default is None:
        return None
    return json_object(value, where + key)


def read_int(obj: Mapping[str, Any], key: str, default: Any = ..., *, lo: int | None = None,
             hi: int | None = None, where: str = "") -> Any:
    value = obj.get(key, default)
    if value is ...:
        raise ApiValidationError(where + key, "is required")
    if value is None and default is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiValidationError(where + key, f"expected an integer, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        rng = (f">= {lo}" if hi is None else f"<= {hi}" if lo is None
               else f"between {lo} and {hi}")
        raise ApiValidationError(where + key, f"must be {rng}, got {value}")
    return value


def read_float(obj: Mapping[str, Any], key: str, default: Any = ..., *, lo: float | None = None,
               hi: float | None = None, where: str = "") -> float:
    value = obj.get(key, default)
    if value is ...:
        raise ApiValidationError(where + key, "is required")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ApiValidationError(where + key, f"expected a finite number, got {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise ApiValidationError(where + key, f"must be in [{lo}, {hi}], got {value}")
    return float(value)


def read_bool(obj: Mapping[str, Any], key: str, default: bool, where: str = "") -> bool:
    value = obj.get(key, default)
    if not isinstance(value, bool):
        raise ApiValidationError(where + key, f"expected true or false, got {value!r}")
    return value


def read_str(obj: Mapping[str, Any], key: str, default: Any = ..., *,
             choices: Sequence[str] | None = None, where: str = "") -> Any:
    value = obj.get(key, default)
    if value is ...:
        raise ApiValidationError(where + key, "is required")
    if value is None and default is None:
        return None
    if not isinstance(value, str):
        raise ApiValidationError(where + key, f"expected a string, got {value!r}")
    if choices is not None and value not in choices:
        raise ApiValidationError(where + key, f"must be one of {list(choices)}, got {value!r}")
    return value


def is_token_ids(value: Any) -> bool:
    """A list of token ids: integers (not bools) in [0, 2**32)."""
    return isinstance(value, list) and all(type(t) is int and 0 <= t < 2**32 for t in value)


def read_token_ids(obj: Mapping[str, Any], key: str, default: Any = ...,
                   where: str = "") -> list[int]:
    value = obj.get(key, default)
    if value is ...:
        raise ApiValidationError(where + key, "is required")
    if not is_token_ids(value):
        raise ApiValidationError(where + key, "expected a list of token ids (integers in [0, 2**32))")
    return value


@overload
def read_keys(obj: Mapping[str, Any], key: str, where: str = "", *,
              optional: Literal[False] = False) -> list[BlockKey]: ...
@overload
def read_keys(obj: Mapping[str, Any], key: str, where: str = "", *,
              optional: Literal[True]) -> list[BlockKey] | None: ...
def read_keys(obj: Mapping[str, Any], key: str, where: str = "", *,
              optional: bool = False) -> list[BlockKey] | None:
    value = obj.get(key)
    if value is None and optional:
        return None
    if not isinstance(value, list):
        raise ApiValidationError(where + key, "expected a list of hex block keys")
    try:
        return [BlockKey.from_hex(k) for k in value]
    except (TypeError, ValueError) as exc:
        raise ApiValidationError(where + key, f"bad block key: {exc}") from None


def read_figures(cls: type, obj: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The keyword arguments of ``cls``, a dataclass of non-negative figures: each field is
    read as an integer or as a number after its default (``0`` or ``0.0``), its default too."""
    return {
        f.name: read_int(obj, f.name, f.default, lo=0, where=where) if type(f.default) is int
        else read_float(obj, f.name, f.default, lo=0.0, where=where)
        for f in fields(cls)
    }
