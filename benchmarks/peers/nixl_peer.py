"""NIXL's UCX backend as the one-sided peer of ``store_bench --hosts 2 --transport ucx``.

NIXL (``nixl-cu12``, NVIDIA's transfer library under Dynamo; ``pip install nixl-cu12``, not
a dependency of this package) moves registered memory with one-sided READs and WRITEs: the
initiator names remote addresses it learned from the target's agent metadata, and the
target's process takes no request per transfer. This module gives the benchmark both ends:

- ``serve(max_bytes)`` (on the store's host): an agent ``target`` with the UCX backend that
  registers two regions of ``max_bytes`` (``src``, seeded random bytes like the raw socket
  server's, read by the initiator; ``sink``, written by it), prints one line ``NIXLINFO
  {"meta": hex agent metadata, "src": address, "sink": address}`` and waits until killed;
- ``Initiator(info)`` (on the client's host): an agent ``initiator`` that adds the target
  from that line; ``register(arrays)`` registers the client's buffers of a case (untimed),
  ``read(dst)`` fills ``dst[i]`` from ``src + i * size`` and ``write(src)`` puts ``src[i]``
  at ``sink + i * size``, one transfer request per call over the whole batch (made, posted
  and polled to completion: what a request for named blocks costs), ``release()`` drops the
  registrations.

The exchange of the metadata goes through the benchmark's own process pipes (no NIXL
listener thread, no etcd). Its agent logs go to stdout before the ``NIXLINFO`` line; the
orchestrator skips them.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import numpy as np

__all__ = ["MARK", "available", "serve", "Initiator"]

MARK = "NIXLINFO "


def _api() -> Any:
    import nixl_cu12._api as api  # the wheel's package name; nixl's examples use ``nixl._api``

    return api


def available() -> str | None:
    """None when NIXL imports here, else why not."""
    try:
        _api()
    except Exception as exc:  # noqa: BLE001 - any failure to load its libraries counts
        return f"nixl does not import: {type(exc).__name__}: {exc}"
    return None


def _agent(name: str) -> Any:
    api = _api()
    return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))


def serve(max_bytes: int) -> None:
    """The target: print one MARK line on stdout, then wait to be killed. NIXL's agent logs to
    fd 1, so that is pointed at stderr first: stdout carries the MARK line and nothing else (a
    reader that selects on the pipe would otherwise find the MARK already buffered behind a log
    line and wait for more)."""
    out = os.fdopen(os.dup(1), "w")
    sys.stdout.flush()
    os.dup2(2, 1)
    src = np.random.default_rng(1).integers(0, 256, max_bytes, dtype=np.uint8)
    sink = np.zeros(max_bytes, np.uint8)
    agent = _agent("target")
    agent.register_memory([(src.ctypes.data, max_bytes, 0, ""), (sink.ctypes.data, max_bytes, 0, "")],
                          "DRAM")
    print(MARK + json.dumps({"meta": agent.get_agent_metadata().hex(), "src": src.ctypes.data,
                             "sink": sink.ctypes.data}), file=out, flush=True)
    while True:  # the transfers need nothing from this process; the orchestrator kills it
        time.sleep(3600)


class Initiator:
    """The client's end (module docstring)."""

    def __init__(self, info: dict[str, Any]) -> None:
        self.agent = _agent("initiator")
        self.remote = self.agent.add_remote_agent(bytes.fromhex(info["meta"]))
        self.src, self.sink = int(info["src"]), int(info["sink"])
        self._regs: list[Any] = []

    def register(self, arrays: list[np.ndarray]) -> None:
        self._regs.append(self.agent.register_memory(
            [(a.ctypes.data, a.nbytes, 0, "") for a in arrays], "DRAM"))

    def release(self) -> None:
        for reg in self._regs:
            self.agent.deregister_memory(reg)
        self._regs.clear()

    def _move(self, op: str, local: list[np.ndarray], base: int) -> None:
        size = local[0].nbytes
        mine = self.agent.get_xfer_descs([(a.ctypes.data, a.nbytes, 0) for a in local], "DRAM")
        theirs = self.agent.get_xfer_descs([(base + i * size, size, 0) for i in range(len(local))],
                                           "DRAM")
        handle = self.agent.initialize_xfer(op, mine, theirs, self.remote)
        try:
            state = self.agent.transfer(handle)
            while state == "PROC":
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"NIXL {op} of {len(local)} x {size} bytes ended {state}")
        finally:
            self.agent.release_xfer_handle(handle)

    def read(self, dst: list[np.ndarray]) -> None:
        self._move("READ", dst, self.src)

    def write(self, src: list[np.ndarray]) -> None:
        self._move("WRITE", src, self.sink)

