"""NVIDIA Dynamo radix-tree driver for ``benchmarks/serving/router_bench.py --peer dynamo``.

Runs in Dynamo's own virtual environment (``pip install ai-dynamo-runtime``), never in the
project's: the project process talks to it over stdin/stdout, one JSON object a line. It
imports nothing from this repository and needs nothing but the standard library and
``dynamo.llm``.

It prints ``{"ready": true, "version": ...}`` and then answers each request line::

    {"op": "load", "path": FILE}
        FILE holds {"events": [[worker, "stored"|"removed", [hash, ...], parent|null], ...]}.
        A fresh ``dynamo.llm.RadixTree`` gets every event through ``apply_event`` (Dynamo's
        JSON event bytes, serialized before timing starts).
      -> {"events": n, "blocks": n, "total_s": s, "event_ns": [...]}
    {"op": "query", "path": FILE, "repeat": R}
        FILE holds {"queries": [[hash, ...], ...]}; each is answered ``R`` times by
        ``find_matches`` (its ``scores`` read back: the router needs them).
      -> {"ns": [...], "scores": [{worker: blocks}, ...]}   (scores of the first repetition)
    {"op": "hash", "path": FILE}
        FILE holds {"block_size": B, "prompts": [[token, ...], ...]}; each is hashed with
        ``compute_block_hash_for_seq`` (Dynamo's own per-block hashing).
      -> {"ns": [...]}
    {"op": "quit"}

An error is answered ``{"error": "..."}``. Hashes are unsigned 64-bit integers; the caller
uses the same value as a block's ``tokens_hash`` and ``block_hash``.
"""

from __future__ import annotations

import json
import sys
import time
from importlib import metadata


def _event_bytes(event_id: int, kind: str, hashes: list[int], parent: int | None) -> bytes:
    if kind == "stored":
        data = {"stored": {"parent_hash": parent,
                           "blocks": [{"block_hash": h, "tokens_hash": h} for h in hashes]}}
    else:
        data = {"removed": {"block_hashes": hashes}}
    return json.dumps({"event_id": event_id, "data": data}).encode()


class Driver:
    def __init__(self) -> None:
        from dynamo.llm import RadixTree

        self._cls = RadixTree
        self.tree = RadixTree()

    def load(self, path: str) -> dict:
        with open(path) as f:
            events = json.load(f)["events"]
        self.tree = self._cls()
        encoded = [(w, _event_bytes(i + 1, kind, hashes, parent))
                   for i, (w, kind, hashes, parent) in enumerate(events)]
        apply, clock = self.tree.apply_event, time.perf_counter_ns
        times = []
        start = clock()
        for w, raw in encoded:
            t0 = clock()
            apply(w, raw)
            times.append(clock() - t0)
        self.tree.find_matches([0])  # a barrier, should event application be asynchronous
        total = (clock() - start) / 1e9
        return {"events": len(events), "blocks": sum(len(e[2]) for e in events),
                "total_s": total, "event_ns": times}

    def query(self, path: str, repeat: int) -> dict:
        with open(path) as f:
            queries = json.load(f)["queries"]
        find, clock = self.tree.find_matches, time.perf_counter_ns
        times, scores = [], []
        for r in range(repeat):
            for q in queries:
                t0 = clock()
                s = find(q).scores
                times.append(clock() - t0)
                if r == 0:
                    scores.append({str(w): n for (w, _dp), n in s.items()})
        return {"ns": times, "scores": scores}

    def hash(self, path: str) -> dict:
        from dynamo.llm import compute_block_hash_for_seq

        with open(path) as f:
            spec = json.load(f)
        clock, times = time.perf_counter_ns, []
        for tokens in spec["prompts"]:
            t0 = clock()
            compute_block_hash_for_seq(tokens, spec["block_size"])
            times.append(clock() - t0)
        return {"ns": times}


def main() -> None:
    try:
        driver = Driver()
        version = metadata.version("ai-dynamo-runtime")
    except Exception as exc:  # noqa: BLE001 - reported to the caller, who explains it
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return
    print(json.dumps({"ready": True, "version": version}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        op = req.get("op")
        try:
            if op == "quit":
                break
            if op == "load":
                out = driver.load(req["path"])
            elif op == "query":
                out = driver.query(req["path"], int(req.get("repeat", 1)))
            elif op == "hash":
                out = driver.hash(req["path"])
            else:
                out = {"error": f"unknown op {op!r}"}
        except Exception as exc:  # noqa: BLE001
            out = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
