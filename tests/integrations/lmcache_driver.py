"""LMCache's engine driven over stdin/stdout, run by tests/integrations/test_lmcache.py in
.venv-lmcache (LMCache cannot share the project's environment).

One JSON command a line in, one JSON answer a line out (``{"error": ...}`` when a command
raised: the tests assert there is none)::

    {"op": "open", "name": "a", "model": "m1", "address": "host:port", "transport": "auto"}
    {"op": "store", "name": "a", "seed": 1, "tokens": 600, "slot": 0}
        -> {"digests": {"256": ..., "512": ..., "600": ...}}   (sha256 of the KV at the first
           k stored slots, every layer, K then V)
    {"op": "retrieve", "name": "a", "seed": 1, "tokens": 600, "slot": 2048}
        -> {"retrieved": n, "digest": sha256 of the KV at the n slots it loaded into}
    {"op": "stats", "name": "a"} -> the plugin's counters
    {"op": "quit"}

``seed`` picks a prompt (its token ids) and, on store, the KV written at its slots first
(``kv_seed``, when given, picks the KV instead).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
import yaml

from benchmarks.peers.lmcache_engine import LMCacheRig
from kvstore.integrations.lmcache_plugin import KVStorePlugin

CHUNK = 256


DOCS = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"


def config(address: str, transport: str) -> dict[str, Any]:
    """The YAML that docs/integrations.md shows (its "LMCache storage plugin" section), with
    the daemon's address and the transport put in: what users copy is what is tested."""
    text = DOCS.read_text()
    section = text[text.index("## LMCache storage plugin"):]
    block = section[section.index("```yaml\n") + 8:]
    cfg = yaml.safe_load(block[:block.index("```")])
    assert cfg["chunk_size"] == CHUNK and cfg["local_cpu"] is False, cfg
    cfg["extra_config"]["storage_plugin.kvstore.address"] = address
    cfg["extra_config"]["storage_plugin.kvstore.transport"] = transport
    return cfg


def prompt(seed: int, n: int) -> torch.Tensor:
    return torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(seed))


def digest(kv: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in kv:
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def plugin(rig: LMCacheRig) -> KVStorePlugin:
    manager = rig.engine.storage_manager
    assert manager is not None
    found = [b for b in manager.storage_backends.values() if isinstance(b, KVStorePlugin)]
    assert found, f"LMCache loaded no KVStorePlugin: {list(manager.storage_backends)}"
    return found[0]


def main() -> None:
    rigs: dict[str, LMCacheRig] = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        try:
            if op == "quit":
                break
            if op == "open":
                rigs[cmd["name"]] = LMCacheRig(config(cmd["address"], cmd.get("transport", "auto")),
                                               model_name=cmd["model"], slots=cmd.get("slots", 4096))
                out: dict[str, Any] = {"backends": list(rigs[cmd["name"]].engine.storage_manager.storage_backends)}
            elif op == "store":
                rig = rigs[cmd["name"]]
                n, slot = cmd["tokens"], cmd["slot"]
                slots = torch.arange(slot, slot + n)
                rig.fill(slots, cmd.get("kv_seed", cmd["seed"]))
                rig.store(prompt(cmd["seed"], n), slots)
                rig.wait_stored()
                ks = sorted({*range(CHUNK, n + 1, CHUNK), n})
                out = {"digests": {str(k): digest(rig.kv(slots[:k])) for k in ks}}
            elif op == "retrieve":
                rig = rigs[cmd["name"]]
                n, slot = cmd["tokens"], cmd["slot"]
                slots = torch.arange(slot, slot + n)
                got = rig.retrieve(prompt(cmd["seed"], n), slots)
                out = {"retrieved": got, "digest": digest(rig.kv(slots[:got]))}
            elif op == "stats":
                out = dataclasses.asdict(plugin(rigs[cmd["name"]]).stats)
            else:
                out = {"error": f"unknown op {op!r}"}
        except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
            out = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(out), flush=True)
    for rig in rigs.values():
        rig.close()


if __name__ == "__main__":
    main()
