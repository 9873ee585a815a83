"""Regenerate golden_keys.json. Only run this on purpose: changing the vectors changes every key."""

import json
from pathlib import Path

from kvstore.keys import block_keys, namespace_id, salted

CASES = [
    {"facts": {"model": "golden", "dtype": "float32", "block_size": 4}, "salt": None,
     "tokens": list(range(10)), "block_size": 4},
    {"facts": {"model": "golden", "dtype": "bfloat16", "block_size": 16}, "salt": "tenant-a",
     "tokens": [1, 2, 3] * 11, "block_size": 16},
    {"facts": {"model": "golden", "layout": [1, 2, 3], "unicode": "é"}, "salt": None,
     "tokens": [4294967295, 0, 65536, 7], "block_size": 2},
]

if __name__ == "__main__":
    out = []
    for case in CASES:
        ns = salted(namespace_id(case["facts"]), case["salt"])
        keys = block_keys(ns, case["tokens"], case["block_size"])
        out.append({**case, "namespace": ns.hex(), "keys": [k.hex() for k in keys]})
    Path(__file__).with_name("golden_keys.json").write_text(json.dumps(out, indent=1) + "\n")
