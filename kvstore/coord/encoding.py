"""How etcd's HTTP/JSON gateway spells keys, values and ranges; shared by the client
(``kvstore.coord.etcd``) and the watch stream (``kvstore.coord.watch``).

- Keys and values travel base64-encoded (``b64`` / ``unb64``); a field at its default value
  is omitted in replies, so an absent value decodes to ``b""``.
- A prefix is the range ``[prefix, prefix_range_end(prefix))``: the prefix with its last byte
  below 0xFF incremented (trailing 0xFF bytes dropped); the empty prefix is every key
  (range end ``b"\\0"``).
"""

from __future__ import annotations

import base64

__all__ = ["b64", "unb64", "prefix_range_end"]


def b64(data: str | bytes) -> str:
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    return base64.b64encode(raw).decode("ascii")


def unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_range_end(prefix: str | bytes) -> bytes:
    """The etcd ``range_end`` that selects every key starting with ``prefix``."""
    raw = bytearray(prefix.encode("utf-8") if isinstance(prefix, str) else prefix)
    while raw:
        if raw[-1] < 0xFF:
            raw[-1] += 1
            return bytes(raw)
        raw.pop()
    return b"\0"  # empty prefix: every key
