import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvstore.keys import BlockKey, block_keys, extend_block_keys, namespace_id, salted

GOLDEN = json.loads(Path(__file__).with_name("golden_keys.json").read_text())


@pytest.mark.parametrize("case", GOLDEN, ids=lambda c: c["facts"]["model"] + str(c["block_size"]))
def test_golden_vectors(case):
    ns = salted(namespace_id(case["facts"]), case["salt"])
    assert ns.hex() == case["namespace"]
    assert [k.hex() for k in block_keys(ns, case["tokens"], case["block_size"])] == case["keys"]


def test_only_full_blocks_get_keys():
    ns = namespace_id({"m": 1})
    assert len(block_keys(ns, list(range(15)), 16)) == 0
    assert len(block_keys(ns, list(range(16)), 16)) == 1
    assert len(block_keys(ns, list(range(33)), 16)) == 2


def test_chain_depends_on_every_earlier_block_and_namespace():
    ns = namespace_id({"m": 1})
    a = block_keys(ns, [1] * 8 + [2] * 8, 8)
    b = block_keys(ns, [9] * 8 + [2] * 8, 8)
    assert a[1] != b[1]  # same block tokens, different parent
    assert block_keys(namespace_id({"m": 2}), [1] * 8, 8)[0] != a[0]
    assert block_keys(salted(ns, "tenant"), [1] * 8, 8)[0] != a[0]
    assert salted(ns, None) == ns and salted(ns, "") == ns


def test_extend_hashes_only_new_blocks_and_matches_full():
    ns = namespace_id({"m": 1})
    tokens = list(range(100))
    keys = extend_block_keys(ns, [], tokens[:40], 16)
    assert len(keys) == 2
    keys = extend_block_keys(ns, keys, tokens, 16)
    assert keys == block_keys(ns, tokens, 16)
    with pytest.raises(ValueError):
        extend_block_keys(ns, keys, tokens[:20], 16)


def test_numpy_and_list_tokens_agree():
    ns = namespace_id({"m": 1})
    tokens = [5, 6, 7, 8]
    assert block_keys(ns, tokens, 2) == block_keys(ns, np.array(tokens, dtype=np.int64), 2)


def test_bad_input():
    ns = namespace_id({"m": 1})
    with pytest.raises(ValueError):
        BlockKey(b"short")
    with pytest.raises(ValueError, match="2\\*\\*32"):
        block_keys(ns, [-1, 2], 2)
    with pytest.raises(ValueError):
        block_keys(ns, [1, 2], 0)


@pytest.mark.usefixtures("procs")  # starts processes: the integration tier
def test_keys_identical_across_processes_with_different_hash_seeds():
    code = (
        "from kvstore.keys import *; ns = salted(namespace_id({'model': 'x', 'dtype': 'f32'}), 's');"
        "print(','.join(k.hex() for k in block_keys(ns, list(range(64)), 16)))"
    )
    outs = set()
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, check=True,
                                capture_output=True, text=True).stdout)
    assert len(outs) == 1 and outs.pop().count(",") == 3


def test_list_tuple_and_array_fast_paths_agree_with_numpy():
    ns = namespace_id({"m": 1})
    tokens = np.random.default_rng(0).integers(0, 2**32, 16 * 40 + 7, dtype=np.uint64)
    want = block_keys(ns, tokens.astype(np.uint32), 16)
    assert len(want) == 40 and all(type(k) is BlockKey for k in want)
    for form in (tokens, tokens.tolist(), tuple(tokens.tolist()), [np.int64(t) for t in tokens]):
        assert block_keys(ns, form, 16) == want


@pytest.mark.parametrize("bad", [[True, False], [1.5, 2], [2**32, 1], [1, -1], [[1, 2]], ["a", "b"]])
def test_the_list_fast_path_refuses_what_numpy_refuses(bad):
    with pytest.raises(ValueError):
        block_keys(namespace_id({"m": 1}), bad, 1)


@pytest.fixture(params=["native", "python"])
def key_path(request, monkeypatch):
    """Run a test on the C key function and on the Python loop (``kvstore.keys._native``)."""
    import kvstore.keys as keys_module
    from kvstore.native.keys import block_keys_fn

    if request.param == "native":
        fn = block_keys_fn()
        from kvstore.native.keys import LIBRARY
        from tests.native import require_native

        require_native(fn is not None, "the native key path", LIBRARY.why)
        monkeypatch.setattr(keys_module, "_native", [fn])
    else:
        monkeypatch.setattr(keys_module, "_native", [None])
    return request.param


@pytest.mark.parametrize("case", GOLDEN, ids=lambda c: c["facts"]["model"] + str(c["block_size"]))
def test_golden_vectors_on_both_paths(case, key_path):
    ns = salted(namespace_id(case["facts"]), case["salt"])
    for form in (list(case["tokens"]), tuple(case["tokens"])):
        keys = block_keys(ns, form, case["block_size"])
        assert [k.hex() for k in keys] == case["keys"]
        assert all(type(k) is BlockKey for k in keys)


def test_both_paths_agree_on_large_ids_extension_and_refusals(key_path):
    ns = namespace_id({"m": 2})
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 2**32, 16 * 64 + 5, dtype=np.uint64).tolist()  # digits past 2**30
    want = block_keys(ns, np.asarray(tokens, dtype=np.uint32), 16)
    assert block_keys(ns, tokens, 16) == want
    assert extend_block_keys(ns, want[:10], tokens, 16) == want
    assert extend_block_keys(ns, want, tokens, 16) == want
    with pytest.raises(ValueError):
        extend_block_keys(ns, want + want[:1], tokens, 16)
    for bad in ([True] * 16, [1.5] * 16, [2**32] * 16, [-1] * 16, [2**70] * 16):
        with pytest.raises(ValueError):
            block_keys(ns, bad, 16)
    assert block_keys(ns, [5] * 15, 16) == []
