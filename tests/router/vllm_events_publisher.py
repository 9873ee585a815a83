"""vLLM's own KV event publisher, driven line by line (run with ``.venv-vllm``'s Python).

Commands on stdin, one JSON object a line; each gets one JSON line back:

- ``{"op": "open", "buffer_steps": N, "topic": T}``: a new ``ZmqEventPublisher`` (the previous
  one shut down) on free loopback ports (``tcp://*:0`` with ``VLLM_HOST_IP=127.0.0.1``);
  answers its ``endpoint`` and ``replay_endpoint``.
- ``{"op": "publish", "events": [...]}``: one ``KVEventBatch`` of those events (``type``
  BlockStored / BlockRemoved / AllBlocksCleared, the rest its fields; a block hash is an int
  or ``{"bytes": hex}``); answers the batch's ``seq`` (vLLM numbers a publisher's batches from 0).
- ``{"op": "close"}``, or end of input: shut the publisher down.

vLLM's logs go to stderr; stdout carries only the answers. The first line is ``{"ready": true}``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

_answers = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)  # anything vLLM prints goes to stderr

from vllm.distributed.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)


def _hash(h: Any) -> Any:
    return bytes.fromhex(h["bytes"]) if isinstance(h, dict) else h


def _event(spec: dict[str, Any]) -> Any:
    spec = dict(spec)
    kind = spec.pop("type")
    if kind == "AllBlocksCleared":
        return AllBlocksCleared()
    spec["block_hashes"] = [_hash(h) for h in spec["block_hashes"]]
    spec.setdefault("medium", "GPU")
    if kind == "BlockRemoved":
        return BlockRemoved(**spec)
    spec["parent_block_hash"] = _hash(spec.get("parent_block_hash"))
    if spec.get("extra_keys") is not None:
        spec["extra_keys"] = [None if e is None else tuple(e) for e in spec["extra_keys"]]
    spec.setdefault("lora_id", None)
    spec.setdefault("lora_name", None)
    return BlockStored(**spec)


def main() -> None:
    pub: ZmqEventPublisher | None = None
    published = 0
    _answers.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "open":
            if pub is not None:
                pub.shutdown()
            pub = ZmqEventPublisher(0, endpoint="tcp://*:0", replay_endpoint="tcp://*:0",
                                    buffer_steps=cmd.get("buffer_steps", 10_000),
                                    topic=cmd.get("topic", ""))
            published = 0
            cfg = pub.get_publisher_config()
            answer: dict[str, Any] = {"endpoint": cfg.endpoint,
                                      "replay_endpoint": cfg.replay_endpoint}
        elif cmd["op"] == "publish":
            assert pub is not None
            pub.publish(KVEventBatch(ts=time.time(), events=[_event(e) for e in cmd["events"]]))
            answer = {"seq": published}
            published += 1
        else:
            break
        _answers.write(json.dumps(answer) + "\n")
    if pub is not None:
        pub.shutdown()


if __name__ == "__main__":
    main()
