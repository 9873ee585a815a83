"""A store node's identity: its ``node_id``, kept in its SSD directory across restarts.

Rules (``kvstore serve``):

- With ``--ssd-path``, the id lives in ``{ssd_path}/node_id`` (0600, written atomically). A
  node restarted on the same directory reuses it, so it owns the same keys in placement and
  serves what its SSD tier kept (the tier reloads its index at open, ``kvstore.node.ssd_tier``).
- ``--node-id ID`` names the node. On a directory that has no id yet, ID is written there. On
  one whose id differs, the daemon refuses to start (``ValueError``: one line, exit 2): the
  blocks on that disk were placed for the other id, and two live nodes must never share one.
  Delete the file (or the directory) to give a disk a new identity on purpose.
- Without ``--ssd-path`` the id is ``--node-id``, else a fresh random one per run.

A damaged SSD tier is moved aside with the id carried over (``ssd_tier``, "move-aside").
"""

from __future__ import annotations

import os
import uuid

from kvstore.coord import layout

__all__ = ["resolve_node_id", "ID_FILE"]

ID_FILE = "node_id"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def _write(path: str, node_id: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(node_id + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def resolve_node_id(ssd_path: str | None, explicit: str | None = None) -> str:
    """The node's id under the rules of the module docstring."""
    if explicit is not None:
        layout.store_key("x", explicit)  # non-empty, no '/': ValueError otherwise
    if not ssd_path:
        return explicit or uuid.uuid4().hex
    os.makedirs(ssd_path, mode=0o700, exist_ok=True)
    path = os.path.join(ssd_path, ID_FILE)
    kept = _read(path)
    if kept is not None:
        if explicit is not None and explicit != kept:
            raise ValueError(
                f"--node-id {explicit} conflicts with the id {kept} kept in {path}: that disk's "
                f"blocks belong to {kept}; start with --node-id {kept} (or none), or delete "
                f"{path} to give the disk a new identity")
        return kept
    node_id = explicit or uuid.uuid4().hex
    _write(path, node_id)
    return node_id
