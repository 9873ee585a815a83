"""Disaggregated serving with real processes: prefill worker -> kvstore daemon -> decode worker.

Oracles: a colocated worker's greedy output and Hugging Face transformers' on the same tiny
checkpoint. The decode worker's final stats prove it loaded every full prompt block from the
store and computed only the partial last block (plus the handed-over first token). Damaged
and missing store blocks are recomputed, counted, and change nothing in the output. A worker
registers in etcd and drains on SIGTERM.
"""

from __future__ import annotations

import base64
import json
import random
import signal
import threading

import httpx
import pytest

import kvstore
from kvstore.coord import layout
from kvstore.keys import BlockKey, block_keys, salted
from tests.daemons import DaemonFactory
from tests.engine.hf_oracle import assert_same_greedy, hf_greedy
from tests.engine.worker_procs import generate, greedy, metric, start_worker, wait_until

pytestmark = pytest.mark.integration

BS = 16
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    factory = DaemonFactory(tmp_path_factory.mktemp("disagg-store"))
    try:
        yield factory("--metrics-port", "0", memory="64M")
    finally:
        factory.close()


@pytest.fixture(scope="module")
def workers(tiny_llama_dir, store, tmp_path_factory):
    """(prefill, decode, colocated) worker processes, started together."""
    base = tmp_path_factory.mktemp("disagg-workers")
    common = ["--num-blocks", "96", "--block-size", str(BS), "--max-num-batched-tokens", "64"]
    started = []
    try:
        threads = []
        for name, flags in (("prefill", ["--role", "prefill", "--store", store.address]),
                            # forced onto TCP (the same host would take shared memory)
                            ("decode", ["--role", "decode", "--store", store.address,
                                        "--store-transport", "tcp"]),
                            ("colocated", ["--role", "colocated"])):
            slot: list = []
            started.append(slot)
            t = threading.Thread(target=lambda s=slot, n=name, f=flags: s.append(
                start_worker(tiny_llama_dir, base / n, *common, *f)))
            t.start()
            threads.append(t)
        for t in threads:
            t.join()
        procs = [s[0] for s in started]
        assert len(procs) == 3, "a worker failed to start (see its stderr.log)"
        yield tuple(procs)
    finally:
        for slot in started:
            for p in slot:
                p.stop()


@pytest.fixture(scope="module")
def client(store):
    c = kvstore.connect(store.address)
    yield c
    c.close()


def _store_bytes(store, direction: str, path: str) -> float:
    """The store daemon's ``kvstore_bytes_total`` for one direction and path."""
    text = httpx.get(f"http://{store.metrics}/metrics", timeout=10).text
    want = f'kvstore_bytes_total{{direction="{direction}",path="{path}"}}'
    return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(want))


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]


def _disagg(workers, rid: str, prompt: list[int]) -> tuple[list[int], dict, dict]:
    prefill, decode, _ = workers
    first, pre_final = generate(prefill.address, greedy(rid, prompt, MAX_TOKENS, "prefill"))
    assert len(first) == 1 and pre_final["finish_reason"] == "length"
    # The handoff carries the prompt's full-block keys; the decode worker checks them.
    body = greedy(rid, prompt, MAX_TOKENS, "decode", output=first)
    body["block_keys"] = pre_final["block_keys"]
    rest, dec_final = generate(decode.address, body)
    return first + rest, pre_final["stats"], dec_final["stats"], pre_final["block_keys"]


@pytest.mark.parametrize("n", [37, 32, 50])
def test_prefill_store_decode_equals_colocated_and_transformers(workers, client, store, tiny_llama_dir, n):
    prefill, decode, colocated = workers
    prompt = _prompt(n, n)
    tcp_before = _store_bytes(store, "out", "tcp")
    tokens, pre, dec, pre_keys = _disagg(workers, f"pd-{n}", prompt)

    # The handoff: every full prompt block is in the store once the prefill answered, and
    # the answer names them.
    keys = block_keys(BlockKey.from_hex(prefill.namespace), prompt, BS)
    assert all(client.contains(keys))
    assert pre_keys == [k.hex() for k in keys] and len(keys) == n // BS
    assert pre["computed_prompt_tokens"] == n and pre["kv_bytes_saved"] > 0
    # The decode worker computed no prompt token but the partial last block's (+ the first
    # token it was handed); every full block came from the store.
    full = n // BS * BS
    assert dec["store_hit_tokens"] == full and dec["device_hit_tokens"] == 0
    assert dec["computed_prompt_tokens"] == n - full + 1
    assert dec["kv_bytes_loaded"] == pre["kv_bytes_saved"]
    # ... over TCP, as its --store-transport says (the prefill wrote over shared memory).
    assert _store_bytes(store, "out", "tcp") - tcp_before >= dec["kv_bytes_loaded"]

    baseline, _ = generate(colocated.address, greedy(f"co-{n}", prompt, MAX_TOKENS))
    assert tokens == baseline
    theirs, margins = hf_greedy(tiny_llama_dir, prompt, MAX_TOKENS)
    near_ties = assert_same_greedy(tokens, theirs, margins)
    print(f"prompt {n}: {near_ties} near-tie divergence(s) from transformers")


def test_penalties_and_min_tokens_survive_the_handoff_and_a_resume(workers):
    """Output tokens handed over count as produced: prefill -> decode, and a resume after k
    tokens, equal the uninterrupted run (the prefill runs one token with min_tokens > 1)."""
    prefill, decode, colocated = workers
    prompt = _prompt(7, 40)
    sampling = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "repetition_penalty": 1.3,
                "frequency_penalty": 0.6, "presence_penalty": 0.4, "min_tokens": 20,
                "logit_bias": {"5": 3.0}}

    def body(rid: str, phase: str, out: list[int] = ()) -> dict:
        return {"request_id": rid, "prompt_token_ids": prompt, "phase": phase,
                "output_token_ids": list(out), "sampling": sampling}

    whole, _ = generate(colocated.address, body("pen-co", "full"))
    first, pre = generate(prefill.address, body("pen-pd", "prefill"))
    dec = body("pen-pd", "decode", first)
    dec["block_keys"] = pre["block_keys"]
    rest, _ = generate(decode.address, dec)
    assert first + rest == whole
    resumed, _ = generate(colocated.address, body("pen-resume", "full", whole[:9]))
    assert whole[:9] + resumed == whole
    plain, _ = generate(colocated.address, greedy("pen-plain", prompt, MAX_TOKENS))
    assert plain != whole  # the penalties did something


def _damage(client, key: BlockKey) -> None:
    value = bytearray(client.get_bytes([key])[0])
    value[-1] ^= 0x5A  # one payload byte: the checksum no longer matches
    assert client.delete([key]) == 1
    client.put([key], [bytes(value)])


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_damaged_store_block_is_recomputed_and_counted(workers, client, damage):
    prefill, decode, colocated = workers
    n = 3 * BS + 5
    prompt = _prompt({"corrupt": 101, "missing": 102}[damage], n)
    first, _ = generate(prefill.address, greedy(f"{damage}-p", prompt, MAX_TOKENS, "prefill"))
    keys = block_keys(BlockKey.from_hex(prefill.namespace), prompt, BS)
    if damage == "corrupt":
        _damage(client, keys[1])
    else:
        assert client.delete([keys[1]]) == 1
    before = metric(decode.address, f'kvengine_store_blocks_recomputed_total{{reason="{damage}"}}')

    rest, final = generate(decode.address,
                           greedy(f"{damage}-d", prompt, MAX_TOKENS, "decode", output=first))
    stats = final["stats"]
    assert stats["store_hit_tokens"] == BS  # block 0 only: block 1 and after are recomputed
    assert stats["computed_prompt_tokens"] == n + 1 - BS
    after = metric(decode.address, f'kvengine_store_blocks_recomputed_total{{reason="{damage}"}}')
    # A corrupt block is found on read and counted; a missing one is already a lookup miss.
    assert after - before == (1 if damage == "corrupt" else 0)
    baseline, _ = generate(colocated.address, greedy(f"{damage}-c", prompt, MAX_TOKENS))
    assert first + rest == baseline


def test_salted_prefill_keys_and_a_decode_with_wrong_keys_is_refused(workers, client):
    """Keys under a cache salt are the salted namespace's; a decode whose given keys differ
    from its own (another salt, a dropped block, a foreign namespace) is refused with 409
    before anything is loaded or computed."""
    prefill, decode, _ = workers
    prompt = _prompt(11, 3 * BS + 3)
    body = greedy("salt-p", prompt, MAX_TOKENS, "prefill")
    body["cache_salt"] = "tenant-a"
    first, pre = generate(prefill.address, body)
    ns = salted(BlockKey.from_hex(prefill.namespace), "tenant-a")
    assert pre["block_keys"] == [k.hex() for k in block_keys(ns, prompt, BS)]

    refused = 'kvengine_requests_rejected_total{reason="block_keys"}'
    before = metric(decode.address, refused)
    unsalted = [k.hex() for k in block_keys(BlockKey.from_hex(decode.namespace), prompt, BS)]
    for name, keys in (("unsalted", unsalted), ("short", pre["block_keys"][:-1]),
                       ("foreign", [bytes(16).hex()] * 3)):
        dec = greedy(f"salt-d-{name}", prompt, MAX_TOKENS, "decode", output=first)
        dec.update(cache_salt="tenant-a", block_keys=keys)
        r = httpx.post(f"{decode.address}/generate", json=dec, timeout=30)
        assert r.status_code == 409, (name, r.text)
        err = r.json()
        assert err["field"] == "block_keys" and "disagree" in err["error"], err
        assert decode.namespace in err["error"]
    assert metric(decode.address, refused) == before + 3
    # Malformed keys are a 400 naming the field; the right keys are served.
    dec = greedy("salt-d-bad", prompt, MAX_TOKENS, "decode", output=first)
    dec.update(cache_salt="tenant-a", block_keys=["xyz"])
    r = httpx.post(f"{decode.address}/generate", json=dec, timeout=30)
    assert r.status_code == 400 and r.json()["field"] == "block_keys"
    dec.update(request_id="salt-d-ok", block_keys=pre["block_keys"])
    rest, final = generate(decode.address, dec)
    assert len(rest) == MAX_TOKENS - 1 and final["stats"]["store_hit_tokens"] == 3 * BS
    assert "block_keys" not in final  # only a prefill's final line carries them


def test_decode_with_device_hit_skips_the_store(workers):
    """A second decode of the same prompt hits the decode worker's own prefix cache."""
    _, decode, _ = workers
    prompt = _prompt(7, 40)
    tokens, _, dec, _ = _disagg(workers, "dev-1", prompt)
    again, final = generate(decode.address,
                            greedy("dev-2", prompt, MAX_TOKENS, "decode", output=tokens[:1]))
    assert tokens[1:] == again
    assert final["stats"]["device_hit_tokens"] == 32 and final["stats"]["store_hit_tokens"] == 0


def test_registers_in_etcd_and_drains_on_sigterm(tiny_llama_dir, store, etcd, unique_prefix,
                                                 tmp_path):
    cluster = unique_prefix.strip("/")
    w = start_worker(tiny_llama_dir, tmp_path / "w", "--role", "decode", "--store", store.address,
                     "--etcd", etcd, "--cluster", cluster, "--worker-id", "dec-1",
                     "--num-blocks", "64")
    try:
        key = layout.worker_key(cluster, "dec-1")
        with httpx.Client(timeout=10) as http:
            def registered():  # etcd's JSON gateway speaks base64

                r = http.post(f"{etcd}/v3/kv/range",
                              json={"key": base64.b64encode(key.encode()).decode()}).json()
                kvs = r.get("kvs", [])
                return json.loads(base64.b64decode(kvs[0]["value"])) if kvs else None

            value = registered()
            assert value is not None
            assert value["role"] == "decode" and value["address"] == w.address
            assert value["namespace"] == w.namespace and value["block_size"] == BS
            assert value["kv_capacity_blocks"] == 64 and value["max_model_len"] > 0

            # A long request is running when SIGTERM arrives: it finishes; new ones get 503.
            result: dict = {}
            body = greedy("long", _prompt(9, 20), 1000)
            t = threading.Thread(target=lambda: result.update(out=generate(w.address, body)))
            t.start()
            wait_until(lambda: metric(w.address, "kvengine_generation_tokens_total") >= 2,
                       what="the long request to start")
            w.proc.send_signal(signal.SIGTERM)
            wait_until(lambda: http.get(f"{w.address}/health").status_code == 503,
                       what="the drain to start")
            refused = http.post(f"{w.address}/generate", json=greedy("late", [5, 6, 7], 4))
            assert refused.status_code == 503 and "draining" in refused.json()["error"]
            t.join(60)
            tokens, final = result["out"]
            assert final["finish_reason"] == "length" and len(tokens) == 1000
            assert w.proc.wait(30) == 0
            assert registered() is None
    finally:
        w.kill()
