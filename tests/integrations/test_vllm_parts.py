"""The vLLM connector's parts that run without vLLM, against a real daemon: where a block lies
in the backends' caches (the CPU backend's and FlashAttention's shapes, on CPU tensors), the
worker side's loads and saves (verified, leading run, failure as a miss, a decode waiting for
a prefill's blocks), and the scheduler side's plans over a prompt's life."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvstore import codec
from kvstore.integrations.store_link import StoreLink, StoreSettings
from kvstore.integrations.vllm.layout import BlockLayout, LayoutError
from kvstore.integrations.vllm.scheduler import SchedulerSide
from kvstore.integrations.vllm.specs import LoadSpec, SaveSpec, for_rank, request_namespace
from kvstore.integrations.vllm.transfers import Transfers
from kvstore.keys import block_keys, namespace_id

SECRET = "vllm-parts-secret"
NS = namespace_id({"test": "vllm-parts"})


@pytest.fixture
def store(tmp_path: Path, start_daemon) -> StoreSettings:
    secret = tmp_path / "secret"
    secret.write_text(SECRET)
    d = start_daemon(memory="64M", env={"KVCACHE_CLUSTER_SECRET": SECRET})
    return StoreSettings(address=d.address, secret_file=str(secret), timeout=2.0)


def cpu_caches(num_blocks: int = 12, layers: int = 3, seed: int = 0) -> dict[str, torch.Tensor]:
    """The CPU backend's per-layer caches: [num_blocks, kv_heads, block_size, 2 * head_size]."""
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(num_blocks, 2, 32, 64, generator=g)
            for i in range(layers)}


def transfers(settings: StoreSettings, caches: dict[str, torch.Tensor], **kw) -> Transfers:
    layout = BlockLayout.from_kv_caches(caches, next(iter(caches.values())).shape[0])
    return Transfers(StoreLink(settings), StoreLink(settings), layout, "float32", **kw)


def wait_idle(t: Transfers, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not t.idle():
        assert time.monotonic() < deadline, "transfers did not finish"
        time.sleep(0.01)


# --- layout ------------------------------------------------------------------------------------


def test_cpu_layout_orders_layers_naturally_and_gathers_a_blocks_bytes() -> None:
    caches = {f"layers.{i}.attn": torch.randn(10, 2, 32, 64) for i in (0, 2, 10, 1)}
    layout = BlockLayout.from_kv_caches(caches, 10)
    assert layout.block_shape == (4, 2 * 32 * 64) and not layout.is_cuda
    rows = torch.zeros(2, layout.payload_bytes, dtype=torch.uint8)
    layout.gather([3, 7], rows)
    payload = rows[1].view(torch.float32).view(4, -1)
    for i, name in enumerate(["layers.0.attn", "layers.1.attn", "layers.2.attn", "layers.10.attn"]):
        assert torch.equal(payload[i], caches[name][7].flatten())


def test_flash_attention_layout_splits_k_and_v_and_scatters_back() -> None:
    # FlashAttention's [2, num_blocks, block_size, kv_heads, head_size]: K and V are two runs.
    src = {f"l.{i}": torch.randn(2, 10, 16, 2, 8) for i in range(2)}
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    a, b = BlockLayout.from_kv_caches(src, 10), BlockLayout.from_kv_caches(dst, 10)
    assert a.block_shape == (4, 16 * 2 * 8)
    rows = torch.empty(2, a.payload_bytes, dtype=torch.uint8)
    a.gather([4, 1], rows)
    b.scatter([6, 0], rows)
    for k in src:
        assert torch.equal(dst[k][:, 6], src[k][:, 4]) and torch.equal(dst[k][:, 0], src[k][:, 1])
    assert dst["l.0"][:, 2].abs().sum() == 0


def test_layout_takes_split_kernel_blocks_and_shared_layers_once_and_refuses_what_is_not_a_run() -> None:
    t = torch.randn(10, 2, 4)  # 5 scheduler blocks of 2 kernel blocks each
    assert BlockLayout.from_kv_caches({"a": t}, 5).block_shape == (1, 16)
    shared = torch.randn(6, 8)
    assert len(BlockLayout.from_kv_caches({"a.0": shared, "a.1": shared}, 6).views) == 1
    with pytest.raises(LayoutError, match="counts the 7 blocks"):
        BlockLayout.from_kv_caches({"a": torch.randn(6, 8)}, 7)
    with pytest.raises(LayoutError, match="not one contiguous run"):
        BlockLayout.from_kv_caches({"a": torch.randn(8, 6).t()}, 6)


# --- keys --------------------------------------------------------------------------------------


def test_keys_differ_by_salt_lora_and_tp_rank_and_never_by_process() -> None:
    plain = request_namespace(NS, None, None)
    assert plain == NS
    assert request_namespace(NS, "tenant-a", None) != request_namespace(NS, "tenant-b", None)
    lora = SimpleNamespace(lora_name="sql", lora_path="/adapters/sql")
    assert request_namespace(NS, None, lora) not in (NS, request_namespace(NS, "sql", None))
    keys = block_keys(NS, list(range(64)), 32)
    assert for_rank(keys, 0, 1) == keys
    r0, r1 = for_rank(keys, 0, 2), for_rank(keys, 1, 2)
    assert len({*keys, *r0, *r1}) == 6 and for_rank(keys, 1, 2) == r1


# --- transfers, against a real daemon -------------------------------------------------------


def test_saved_blocks_load_bit_for_bit_into_another_cache(store) -> None:
    src, dst = cpu_caches(seed=1), {k: torch.zeros_like(v) for k, v in cpu_caches().items()}
    keys = tuple(block_keys(NS, list(range(4 * 32)), 32))
    a, b = transfers(store, src), transfers(store, dst)
    try:
        a.save(SaveSpec("r1", keys, (5, 2, 9, 0)))
        assert a.finish("r1") in (True, False)
        wait_idle(a)
        assert a.snapshot().saved_blocks == 4
        sent, _, _ = a.poll()
        assert sent == {"r1"}  # reported once its saves were done
        a.save(SaveSpec("r2", keys, (5, 2, 9, 0)))  # already stored: skipped, not put again
        wait_idle(a)
        assert a.snapshot().skipped_blocks == 4
        b.load(LoadSpec("r3", keys, (1, 3, 4, 11)))
        wait_idle(b)
        _, recved, failed = b.poll()
        assert recved == {"r3"} and not failed
        for name in src:
            for s, d in zip((5, 2, 9, 0), (1, 3, 4, 11)):
                assert torch.equal(dst[name][d], src[name][s])
        assert b.snapshot().loaded_blocks == 4
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("load_path", ["auto", "staged", "python"])
def test_a_corrupt_block_and_those_after_it_are_reported_failed_never_written(store, load_path) -> None:
    src, dst = cpu_caches(seed=2), {k: torch.zeros_like(v) for k, v in cpu_caches().items()}
    keys = tuple(block_keys(NS, list(range(100, 100 + 4 * 32)), 32))
    a, b = transfers(store, src), transfers(store, dst, load_path=load_path)
    try:
        a.save(SaveSpec("r", keys, (0, 1, 2, 3)))
        wait_idle(a)
        client = store.connect()
        client.delete([keys[2]])  # block 2 comes back damaged: its payload's last byte flipped
        bad = bytearray(codec.encode(keys[2], "float32", b.layout.block_shape,
                                     src["model.layers.0.self_attn.attn"].new_zeros(b.layout.block_shape).numpy()))
        bad[-1] ^= 0xFF
        assert client.put([keys[2]], [bytes(bad)]) == [True]
        client.close()
        b.load(LoadSpec("r", keys, (4, 5, 6, 7)))
        wait_idle(b)
        _, recved, failed = b.poll()
        assert recved == {"r"} and failed == {6, 7}
        for name in src:
            assert torch.equal(dst[name][4], src[name][0]) and torch.equal(dst[name][5], src[name][1])
            assert dst[name][6].abs().sum() == 0  # unverified bytes never reach the cache
        assert b.snapshot().corrupt_blocks == 1
    finally:
        a.close()
        b.close()


def test_a_dead_store_fails_loads_and_drops_saves_without_raising(tmp_path) -> None:
    dead = StoreSettings(address="127.0.0.1:9", timeout=0.5)
    t = transfers(dead, cpu_caches())
    keys = tuple(block_keys(NS, list(range(64)), 32))
    try:
        t.save(SaveSpec("s", keys, (0, 1)))
        t.load(LoadSpec("l", keys, (2, 3)))
        wait_idle(t)
        assert t.finish("s") is False  # nothing in flight any more
        sent, recved, failed = t.poll()
        assert recved == {"l"} and failed == {2, 3} and sent == {"s"}
        assert t.snapshot().save_failed_blocks == 2
    finally:
        t.close()


def test_a_decode_waits_for_a_prefills_blocks_instead_of_recomputing_them(store) -> None:
    # The store is slow to get the prefill's blocks: the decode's load waits, then loads all.
    src, dst = cpu_caches(seed=3), {k: torch.zeros_like(v) for k, v in cpu_caches().items()}
    keys = tuple(block_keys(NS, list(range(7, 7 + 3 * 32)), 32))
    prefill, decode = transfers(store, src), transfers(store, dst)
    other = tuple(block_keys(NS, list(range(900, 900 + 32)), 32))
    try:
        prefill.save(SaveSpec("o", other, (6,)))
        wait_idle(prefill)
        decode.load(LoadSpec("d", keys, (0, 1, 2), wait_s=10.0))
        decode.load(LoadSpec("x", other, (7,)))  # behind the waiting one: not held up by it
        deadline = time.monotonic() + 5
        while "x" not in decode.poll()[1]:
            assert time.monotonic() < deadline, "a waiting load held up another"
            time.sleep(0.01)
        timer = threading.Timer(0.5, lambda: prefill.save(SaveSpec("p", keys, (3, 4, 5))))
        timer.start()
        wait_idle(decode, 15)
        timer.join()
        _, recved, failed = decode.poll()
        assert recved == {"d"} and not failed
        stats = decode.snapshot()
        assert stats.loaded_blocks == 3 + 1 and stats.waited_s >= 0.4
        for name in src:
            assert torch.equal(dst[name][2], src[name][5])
    finally:
        prefill.close()
        decode.close()


# --- the scheduler side ------------------------------------------------------------------------


def _request(rid: str, prompt: list[int], **kw) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, prompt_token_ids=prompt, cache_salt=kw.get("salt"),
                           lora_request=None, kv_transfer_params=kw.get("params"), num_preemptions=0)


def _output(new=(), cached=(), scheduled=None) -> SimpleNamespace:
    cached = list(cached)
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(ids,), num_computed_tokens=c)
                            for r, ids, c in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _, _ in cached], resumed_req_ids=set(),
                                              new_block_ids=[(ids,) if ids else None for _, ids, _ in cached],
                                              num_computed_tokens=[c for _, _, c in cached]),
        num_scheduled_tokens=dict(scheduled or {}))


def test_scheduler_plans_chunked_saves_then_a_hit_that_never_includes_the_last_token(store) -> None:
    bs, prompt = 32, list(range(1000, 1000 + 4 * 32))  # exactly 4 full blocks
    side = SchedulerSide(StoreLink(store), bytes(NS), bs, load=True, save=True, handoff_wait_s=5)
    req = _request("a", prompt)
    assert side.matched(req, 0) == (0, False)  # an empty store
    side.allocated(req, [10, 11, 12, 13], 0)
    loads, saves = side.build(_output(new=[("a", [10, 11, 12, 13], 0)], scheduled={"a": 64}))
    assert not loads and [s.block_ids for s in saves] == [(10, 11)]  # a chunk of 64 tokens
    loads, saves = side.build(_output(cached=[("a", [], 64)], scheduled={"a": 64}))
    assert [s.block_ids for s in saves] == [(12, 13)]
    assert side.finished(req) == (True, {"kvstore": {"blocks": 4}})
    # Store those blocks, as the worker would, then a new request with the same prompt hits
    # three of them: the fourth holds the last token, which vLLM computes to sample.
    keys = block_keys(NS, prompt, bs)
    client = store.connect()
    client.put(keys, [codec.encode(k, "uint8", (4,), bytes(4)) for k in keys])
    client.close()
    req2 = _request("b", prompt)
    assert side.matched(req2, 0) == (3 * bs, True)
    assert side.matched(req2, 32) == (2 * bs, True)  # one block a device hit
    side.allocated(req2, [20, 21, 22, 23], 2 * bs)
    loads, _ = side.build(_output())
    assert [(load.block_ids, load.keys) for load in loads] == [((21, 22), tuple(keys[1:3]))]
    assert side.matched(req2, 32) == (0, False)  # its load failed: compute, never load forever
    assert side.matched(_request("c", prompt, salt="other tenant"), 0) == (0, False)
    # A device hit of blocks the store lost (evicted, restarted) is saved again; held ones not.
    client = store.connect()
    client.delete([keys[1]])
    client.close()
    req3 = _request("d", prompt)
    side.allocated(req3, [30, 31, 32, 33], 0)
    _, saves = side.build(_output(new=[("d", [30, 31, 32, 33], 3 * bs)], scheduled={"d": bs}))
    assert [(s.block_ids, s.keys) for s in saves] == [((31,), (keys[1],)), ((33,), (keys[3],))]


def test_a_decode_takes_a_prefills_blocks_from_its_params_and_a_dead_store_matches_nothing(store) -> None:
    bs = 32
    side = SchedulerSide(StoreLink(store), bytes(NS), bs, load=True, save=False, handoff_wait_s=7)
    req = _request("d", list(range(3 * bs + 5)), params={"kvstore": {"blocks": 3}})
    assert side.matched(req, 0) == (3 * bs, True)  # nothing stored yet: the load will wait
    side.allocated(req, [1, 2, 3, 4], 3 * bs)
    loads, saves = side.build(_output())
    assert [(load.block_ids, load.wait_s) for load in loads] == [((1, 2, 3), 7)] and not saves
    # Its load failed (vLLM asks again, no preemption between): no second load, it computes.
    assert side.matched(req, 0) == (0, False)
    req.num_preemptions = 1   # preempted after a load: the store is asked afresh
    assert side.matched(req, 0) == (0, False)  # (nothing stored: a miss, not the handoff again)
    assert side.finished(req) == (True, None)  # a consumer hands nothing on
    dead = SchedulerSide(StoreLink(StoreSettings(address="127.0.0.1:9", timeout=0.5)), bytes(NS),
                         bs, load=True, save=True, handoff_wait_s=1)
    assert dead.matched(_request("e", list(range(200))), 0) == (0, False)


# --- registration ------------------------------------------------------------------------------


def test_an_instance_registers_once_its_server_is_healthy_and_leaves_on_close(etcd, unique_prefix) -> None:
    # A plain HTTP server stands in for vLLM's /health: 503 until the instance is up.
    import http.server
    import json as jsonlib

    from engine.api.generate import WorkerInfo
    from kvstore.coord.etcd import EtcdClient
    from kvstore.coord.layout import worker_key
    from kvstore.integrations.vllm.registration import InstanceRegistration, RegisterSettings

    status = {"code": 503}

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status["code"] if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    cluster = unique_prefix.strip("/")
    settings = RegisterSettings.from_mapping({"etcd": etcd, "cluster": cluster, "url": url, "role": "decode",
                                              "kv_events": "tcp://127.0.0.1:5557", "ttl": 2})
    value = {"address": url, "role": "decode", "model": "m", "namespace": bytes(NS).hex(), "block_size": 32,
             "kv_capacity_blocks": 100, "max_model_len": 4096, "engine": "vllm", "kv_events": "tcp://127.0.0.1:5557"}
    reg = InstanceRegistration(settings, value, poll_s=0.05).start()
    client = EtcdClient(etcd)
    key = worker_key(cluster, settings.worker_id)
    try:
        time.sleep(0.3)
        assert client.get(key) is None  # not healthy yet: not registered
        status["code"] = 200
        deadline = time.monotonic() + 10
        while client.get(key) is None:
            assert time.monotonic() < deadline, "never registered"
            time.sleep(0.05)
        info = WorkerInfo.from_etcd_value(settings.worker_id, jsonlib.loads(client.get(key) or b""))
        assert (info.engine, info.role, info.namespace, info.kv_events) == ("vllm", "decode", NS, "tcp://127.0.0.1:5557")
        assert settings.worker_id.startswith("vllm-decode-")
        reg.close()
        assert client.get(key) is None
    finally:
        reg.close()
        client.close()
        server.shutdown()
    with pytest.raises(ValueError, match="role must be one of"):
        RegisterSettings.from_mapping({"etcd": etcd, "url": url, "role": "both"})
    with pytest.raises(ValueError, match="needs url"):
        RegisterSettings.from_mapping({"etcd": etcd, "role": "decode"})


def test_kvrouter_up_runs_each_vllm_worker_with_the_connector_in_its_role(tmp_path) -> None:
    import json as jsonlib

    from router.cluster.vllm_worker import VllmWorker

    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer"), ("colocated", "kv_both")):
        w = VllmWorker(f"{role}-0", role, 8123, tmp_path / "SmolLM2", "http://127.0.0.1:2379", "c1", str(tmp_path),
                       python="/venv/bin/python", extra_args=("--max-num-seqs", "8"))
        argv, env = w.command()
        assert argv[:3] == ["/venv/bin/python", "-m", "kvstore.integrations.vllm.serve"]
        assert argv[-2:] == ["--max-num-seqs", "8"] and "--enforce-eager" in argv
        connector = jsonlib.loads(argv[argv.index("--kv-transfer-config") + 1])
        events = jsonlib.loads(argv[argv.index("--kv-events-config") + 1])
        assert connector["kv_role"] == kv_role and connector["kv_load_failure_policy"] == "recompute"
        reg = connector["kv_connector_extra_config"]["register"]
        assert (reg["url"], reg["role"], reg["worker_id"]) == ("http://127.0.0.1:8123", role, w.worker_id)
        assert events["endpoint"] == reg["kv_events"] == f"ipc://{tmp_path}/{w.worker_id}.events"
        assert "--api-key" not in argv  # the secret travels as a file path (serve.py), never in argv
        assert env["OMP_NUM_THREADS"] == "1"
        import re

        assert re.search(w.ready_pattern, f"kvstore-vllm ready address={w.url} worker_id={w.worker_id}")
