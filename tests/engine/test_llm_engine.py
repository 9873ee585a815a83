"""LLMEngine end to end with the real ModelRunner on the tiny checkpoints.

The oracle is Hugging Face transformers' greedy decoding on the same checkpoint (float32):
token for token, except at a step where transformers' own top-2 logit margin is below 1e-4
(``hf_oracle.NEAR_TIE``); such steps are counted and reported (``near_ties`` property).
Every other path (chunked, unchunked, batched, prefix hit, preemption) must equal it too.
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from pathlib import Path

import pytest
import torch

from engine.core.block_manager import KVEvent
from engine.core.config import EngineConfig
from engine.core.llm_engine import BlockKeyMismatch, Completion, LLMEngine
from engine.core.sampling import SamplingParams
from kvstore.keys import block_keys, salted
from tests.engine.hf_oracle import assert_same_greedy, hf_greedy

torch.set_num_threads(1)

NEW_TOKENS = 40
PROMPTS = [
    [(7 * i + 13 * n) % 500 + 5 for i in range(n)] for n in (5, 16, 23, 41, 64)
]  # lengths around and across block boundaries (block_size 16)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


@functools.cache
def oracle(model_dir: str, prompt: tuple[int, ...]) -> tuple[list[int], list[float]]:
    return hf_greedy(model_dir, list(prompt), NEW_TOKENS)


def make_engine(model_dir: Path, **cfg) -> LLMEngine:
    """An engine on CPU float32 (the oracle's dtype) unless the test says otherwise."""
    cfg.setdefault("num_blocks", 64)
    cfg.setdefault("device", "cpu")
    cfg.setdefault("dtype", "float32")
    return LLMEngine(model_dir, EngineConfig(**cfg))


def check_against_hf(model_dir: Path, prompts: list[list[int]], results: list[Completion],
                     record_property) -> int:
    near_ties = 0
    for prompt, result in zip(prompts, results, strict=True):
        theirs, margins = oracle(str(model_dir), tuple(prompt))
        assert len(result.token_ids) == NEW_TOKENS and result.finish_reason == "length"
        near_ties += assert_same_greedy(result.token_ids, theirs, margins)
    record_property("near_ties", near_ties)
    print(f"near-tie divergences: {near_ties}")
    return near_ties


@pytest.fixture(params=["llama", "qwen3"])
def model_dir(request, tiny_llama_dir: Path, tiny_qwen3_dir: Path) -> Path:
    return {"llama": tiny_llama_dir, "qwen3": tiny_qwen3_dir}[request.param]


def test_greedy_equals_transformers_batched_and_chunked(model_dir: Path, record_property) -> None:
    engine = make_engine(model_dir, max_num_batched_tokens=32)  # chunks of the long prompts
    results = engine.generate(PROMPTS, GREEDY)
    check_against_hf(model_dir, PROMPTS, results, record_property)
    assert all(r.stats.computed_prompt_tokens == len(p) for p, r in zip(PROMPTS, results, strict=False))
    assert engine.block_manager.num_free_blocks == 64


def test_unchunked_and_alone_equal_transformers(tiny_llama_dir: Path, record_property) -> None:
    unchunked = make_engine(tiny_llama_dir, enable_chunked_prefill=False, max_num_batched_tokens=128)
    results = unchunked.generate(PROMPTS, GREEDY)
    alone = [make_engine(tiny_llama_dir).generate([p], GREEDY)[0] for p in PROMPTS[::2]]
    check_against_hf(tiny_llama_dir, PROMPTS, results, record_property)
    assert [r.token_ids for r in alone] == [r.token_ids for r in results[::2]]


def test_prefix_cache_hit_equals_cold_run_and_computes_less(tiny_llama_dir: Path) -> None:
    events: list[KVEvent] = []
    engine = LLMEngine(tiny_llama_dir, EngineConfig(num_blocks=64, device="cpu"),
                       on_kv_event=events.append)
    base = PROMPTS[4]  # 64 tokens: 4 full blocks
    first = engine.generate([base], GREEDY)[0]
    stored = [k for e in events if e.type == "stored" for k in e.keys]
    assert len(stored) == (64 + NEW_TOKENS - 1) // 16  # every full block, prompt and output
    extended = base + first.token_ids[:10] + [11, 12, 13]  # a second turn of the conversation
    warm = engine.generate([extended], GREEDY)[0]
    cold = make_engine(tiny_llama_dir).generate([extended], GREEDY)[0]
    assert warm.token_ids == cold.token_ids
    assert warm.stats.device_hit_tokens == 64
    assert warm.stats.computed_prompt_tokens == len(extended) - 64
    assert cold.stats.computed_prompt_tokens == len(extended)
    # An identical prompt of whole blocks recomputes its last block (the last token needs logits).
    again = engine.generate([base], GREEDY)[0]
    assert again.token_ids == first.token_ids and again.stats.device_hit_tokens == 48


def test_cache_salt_separates_namespaces(tiny_llama_dir: Path) -> None:
    engine = make_engine(tiny_llama_dir)
    engine.generate([PROMPTS[4]], GREEDY)
    engine.add_request("salted", PROMPTS[4], GREEDY, cache_salt="tenant-b")
    stats = None
    while engine.has_unfinished():
        for out in engine.step():
            stats = out.stats
    assert stats is not None and stats.device_hit_tokens == 0


def test_given_block_keys_must_equal_the_engines_own(tiny_llama_dir: Path) -> None:
    """A handoff's keys are checked against the engine's own for the prompt; a mismatch is
    refused before anything is admitted."""
    engine = make_engine(tiny_llama_dir)
    prompt = PROMPTS[4] + [9, 9, 9]                          # 67 tokens: 4 full blocks
    ns = salted(engine.namespace, "t")
    keys = block_keys(ns, prompt, 16)
    engine.add_request("ok", prompt, GREEDY, cache_salt="t", output_token_ids=[5], block_keys=keys)
    assert engine.prompt_block_keys("ok") == keys and len(keys) == 4
    for bad in (block_keys(engine.namespace, prompt, 16), keys[:3], keys[::-1]):
        with pytest.raises(BlockKeyMismatch, match="disagree") as err:
            engine.add_request("bad", prompt, GREEDY, cache_salt="t", block_keys=bad)
        assert engine.namespace.hex() in str(err.value)
        assert engine.scheduler.get("bad") is None and engine.num_waiting == 1


def test_preemption_equals_no_preemption(tiny_llama_dir: Path, record_property) -> None:
    # 5 requests need up to 7 blocks each; 14 blocks force recomputation.
    engine = make_engine(tiny_llama_dir, num_blocks=14)
    results = engine.generate(PROMPTS, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    assert sum(r.stats.num_preemptions for r in results) == engine.scheduler.num_preemptions
    check_against_hf(tiny_llama_dir, PROMPTS, results, record_property)
    assert engine.block_manager.num_free_blocks == 14


def test_seeded_sampling_continues_from_the_middle(tiny_llama_dir: Path) -> None:
    params = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, seed=1234, max_tokens=30,
                            ignore_eos=True, logprobs=1)
    prompt = PROMPTS[2]
    full = make_engine(tiny_llama_dir).generate([prompt], params)[0]
    assert len(full.token_ids) == 30 and len(full.logprobs) == 30
    engine = make_engine(tiny_llama_dir, max_num_batched_tokens=16)
    engine.add_request("resume", prompt, params, output_token_ids=full.token_ids[:12])
    engine.add_request("other", PROMPTS[3], params)  # batch company must not matter
    resumed: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == "resume":
                resumed.extend(out.new_token_ids)
    assert resumed == full.token_ids[12:]
    # An unseeded request is given a seed, reported, which reproduces it.
    unseeded = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    engine.add_request("u", prompt, unseeded)
    got, seed = [], None
    while engine.has_unfinished():
        for out in engine.step():
            got.extend(out.new_token_ids)
            seed = out.seed
    assert seed is not None
    replay = make_engine(tiny_llama_dir).generate(
        [prompt], SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=seed))[0]
    assert replay.token_ids == got


def test_logprobs_of_greedy_tokens(tiny_llama_dir: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    result = make_engine(tiny_llama_dir).generate([PROMPTS[1]], params)[0]
    assert len(result.logprobs) == 8
    for token, lp in zip(result.token_ids, result.logprobs, strict=False):
        assert lp.top[0][0] == token and lp.logprob == pytest.approx(lp.top[0][1])
        assert lp.logprob <= 0.0 and len(lp.top) == 3


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"prompt": [1, 2, 512]}, r"token id 512, outside the vocabulary \[0, 512\)"),
        ({"prompt": [-1, 2]}, "token id -1"),
        ({"prompt": []}, "no tokens"),
        ({"prompt": [1, 2], "output_token_ids": [3, 999]}, "output_token_ids holds token id 999"),
        ({"prompt": [1] * 100, "max_tokens": 200}, "exceeds the context window of 256"),
        ({"prompt": [1, 2], "max_tokens": 2, "output_token_ids": [3, 4]}, "nothing to generate"),
        ({"request_id": "good"}, "already in the engine"),
        ({"request_id": ""}, "non-empty"),
    ],
)
def test_bad_requests_raise_and_do_not_disturb_others(tiny_llama_dir: Path, kwargs, match) -> None:
    engine = make_engine(tiny_llama_dir, max_model_len=256)
    engine.add_request("good", PROMPTS[3], GREEDY)
    tokens = [t for out in engine.step() for t in out.new_token_ids]
    with pytest.raises(ValueError, match=match):
        engine.add_request(
            kwargs.get("request_id", "bad"),
            kwargs.get("prompt", [1, 2, 3]),
            SamplingParams(temperature=0.0, max_tokens=kwargs.get("max_tokens", 8)),
            output_token_ids=kwargs.get("output_token_ids", ()),
        )
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id == "good"
            tokens.extend(out.new_token_ids)
    theirs, _ = oracle(str(tiny_llama_dir), tuple(PROMPTS[3]))
    assert tokens == theirs


def test_engine_level_config_errors(tiny_llama_dir: Path) -> None:
    engine = make_engine(tiny_llama_dir, num_blocks=4, enable_chunked_prefill=False,
                         max_num_batched_tokens=32)
    with pytest.raises(ValueError, match="need 5 KV blocks; the cache has 4"):
        engine.add_request("big", [1] * 60, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="chunked prefill is disabled"):
        engine.add_request("long", [1] * 40, SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        make_engine(tiny_llama_dir, max_model_len=10**6)
    with pytest.raises(ValueError, match="positive integer"):
        EngineConfig(max_num_seqs=0)


def test_abort_mid_run_frees_blocks_and_spares_the_rest(tiny_llama_dir: Path) -> None:
    engine = make_engine(tiny_llama_dir, max_num_batched_tokens=32)
    engine.add_request("keep", PROMPTS[3], GREEDY)
    engine.add_request("drop", PROMPTS[4], GREEDY)
    kept: list[int] = []
    finals = {}
    for i in range(200):
        if i == 5:
            assert engine.abort("drop") and not engine.abort("drop")
        for out in engine.step():
            if out.request_id == "keep":
                kept.extend(out.new_token_ids)
            if out.finished:
                finals[out.request_id] = out.finish_reason
        if not engine.has_unfinished():
            break
    assert finals == {"drop": "abort", "keep": "length"}
    assert kept == oracle(str(tiny_llama_dir), tuple(PROMPTS[3]))[0]
    assert engine.block_manager.num_free_blocks == 64


@pytest.fixture
def store_address():
    """A real kvstore daemon (BlockStore + StoreServer) served from a thread."""
    import threading

    from kvstore.net.server import StoreServer
    from kvstore.node.store import BlockStore, StoreConfig

    store = BlockStore(StoreConfig(memory_bytes=32 << 20))
    server = StoreServer(store, host="127.0.0.1", port=0, node_id="test-node")
    host, port = server.bind()
    thread = threading.Thread(target=server.serve_forever, name="kvstore-test", daemon=True)
    thread.start()
    yield f"{host}:{port}"
    server.shutdown()
    thread.join(timeout=10)
    store.close()


def test_store_hits_through_the_connector_equal_a_cold_run(tiny_llama_dir: Path, store_address: str) -> None:
    """Prefill engine saves to a real store; a second engine loads, computes only the tail."""
    import kvstore
    from engine.kv.connector import KVStoreConnector
    from engine.model.runner import ModelRunner

    prompt = PROMPTS[4] + PROMPTS[2]  # 87 tokens: 5 full blocks + 7
    cold = make_engine(tiny_llama_dir).generate([prompt], GREEDY)[0]
    engines, connectors, clients = [], [], []
    for _ in range(2):
        client = kvstore.connect(store_address, timeout=30.0)  # the test machine is shared
        runner = ModelRunner(tiny_llama_dir, num_blocks=64, device="cpu", dtype="float32")
        conn = KVStoreConnector(client, runner.kv_cache, save_all=True)
        engines.append(LLMEngine(runner, EngineConfig(num_blocks=64), connector=conn))
        connectors.append(conn)
        clients.append(client)
    try:
        prefill = engines[0].generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))[0]
        assert prefill.token_ids == cold.token_ids[:1]
        connectors[0].flush(None).result(timeout=30)  # every queued save acknowledged
        assert connectors[0].stats_snapshot().saved_blocks == 5, connectors[0].stats_snapshot()
        decoded = engines[1].generate([prompt], GREEDY)[0]
        assert decoded.stats.store_hit_tokens == 80, connectors[1].stats_snapshot()
        assert decoded.token_ids == cold.token_ids
        assert decoded.stats.computed_prompt_tokens == 7
    finally:
        for conn, client in zip(connectors, clients, strict=False):
            conn.close()
            client.close()


class _GatedGet:
    """A real store client whose ``get`` (a load) waits until ``release`` is called."""

    def __init__(self, client) -> None:
        self.client = client
        self.gate = threading.Event()
        self.entered = threading.Event()

    def get(self, keys, buffers):
        self.entered.set()
        assert self.gate.wait(60), "the test never released the load"
        return self.client.get(keys, buffers)

    def __getattr__(self, name):
        return getattr(self.client, name)


def test_running_streams_get_tokens_while_a_load_waits(tiny_llama_dir: Path, store_address: str) -> None:
    """A decode engine whose store load blocks keeps stepping its running stream; released, the
    loaded request produces the cold run's greedy tokens from the store's blocks."""
    import kvstore
    from engine.core.request import RequestStatus
    from engine.kv.connector import KVStoreConnector
    from engine.model.runner import ModelRunner

    prompt = PROMPTS[4] + PROMPTS[2]  # 5 full blocks + 7
    cold = make_engine(tiny_llama_dir).generate([prompt], GREEDY)[0]
    clients = [kvstore.connect(store_address, timeout=30.0) for _ in range(3)]
    runner0 = ModelRunner(tiny_llama_dir, num_blocks=64, device="cpu", dtype="float32")
    saver = KVStoreConnector(clients[0], runner0.kv_cache, save_all=True)
    LLMEngine(runner0, EngineConfig(num_blocks=64), connector=saver).generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=1))
    saver.flush(None).result(timeout=30)
    gated = _GatedGet(clients[1])
    runner = ModelRunner(tiny_llama_dir, num_blocks=64, device="cpu", dtype="float32")
    conn = KVStoreConnector(gated, runner.kv_cache, lookup_client=clients[2], save_all=False)
    engine = LLMEngine(runner, EngineConfig(num_blocks=64), connector=conn)
    try:
        engine.add_request("stream", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=40,
                                                               ignore_eos=True))
        tokens: dict[str, list[int]] = {"stream": [], "hit": []}

        def step() -> None:
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids

        while len(tokens["stream"]) < 2:
            step()
        engine.add_request("hit", prompt, GREEDY)
        deadline = time.monotonic() + 30
        while not gated.entered.is_set() and time.monotonic() < deadline:
            step()
        assert gated.entered.is_set(), "the load never started"
        hit = engine.scheduler.loading["hit"].request
        before = len(tokens["stream"])
        for _ in range(5):   # the load is blocked: the stream still gets a token every step
            step()
        assert len(tokens["stream"]) == before + 5 and hit.status is RequestStatus.WAITING_FOR_KV
        gated.gate.set()
        while engine.has_unfinished():
            if engine.waiting_on_io:
                engine.wait_for_io(0.5)
            step()
        assert tokens["hit"] == cold.token_ids
        assert hit.stats.store_hit_tokens == 80 and hit.kv.load.loaded == 5
        assert hit.stats.computed_prompt_tokens == 7
    finally:
        gated.gate.set()
        for c in (saver, conn):
            c.close()
        for client in clients:
            client.close()


@pytest.mark.gpu
def test_cuda_engine_equals_transformers(tiny_llama_dir: Path, record_property) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    engine = make_engine(tiny_llama_dir, device="cuda", dtype="float32", max_num_batched_tokens=32)
    results = engine.generate(PROMPTS, GREEDY)
    check_against_hf(tiny_llama_dir, PROMPTS, results, record_property)
    bf16 = make_engine(tiny_llama_dir, device="cuda", dtype="bfloat16").generate(PROMPTS, GREEDY)
    assert all(len(r.token_ids) == NEW_TOKENS for r in bf16)


@pytest.mark.slow
def test_smollm2_engine_batched_chunked_prefix_hit_equals_transformers(smollm2_dir: Path,
                                                                        record_property) -> None:
    """The whole engine (scheduler, continuous batching, chunked prefill under a small token
    budget, prefix cache) on SmolLM2 against transformers' greedy, prompt by prompt.

    Four chat prompts share a system prompt; the first runs alone for two steps, then three
    more arrive: they hit its cached prefix blocks, and their prompt chunks share steps with
    its decodes. Divergences are allowed only at transformers' near-ties (counted, reported).
    """
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    system = ("<|im_start|>system\nYou are a helpful assistant who answers briefly and "
              "precisely, in plain English.<|im_end|>\n")
    questions = ["What is the capital of France?", "Write a haiku about the sea.",
                 "Name three prime numbers.", "Why is the sky blue?"]
    prompts = [tok.encode(f"{system}<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n").ids
               for q in questions]
    n_new = 32
    engine = make_engine(smollm2_dir, num_blocks=64, max_num_batched_tokens=24, max_num_seqs=4)
    steps = {"chunked": 0, "mixed": 0}
    execute = engine.runner.execute

    def counting(items):
        prefill = [len(i.token_ids) for i in items if len(i.token_ids) > 1 or i.start_pos == 0]
        steps["chunked"] += any(n < max(map(len, prompts)) for n in prefill)
        steps["mixed"] += bool(prefill) and len(prefill) < len(items)
        return execute(items)

    engine.runner.execute = counting
    params = SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True)
    got: dict[str, list[int]] = {f"q{i}": [] for i in range(len(prompts))}
    stats = {}
    engine.add_request("q0", prompts[0], params)
    for step in itertools.count():
        if step == 3:
            for i in range(1, len(prompts)):
                engine.add_request(f"q{i}", prompts[i], params)
        if step > 3 and not engine.has_unfinished():
            break
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
            if out.finished:
                stats[out.request_id] = out.stats

    near_ties = 0
    for i, prompt in enumerate(prompts):
        theirs, margins = hf_greedy(smollm2_dir, prompt, n_new)
        assert len(got[f"q{i}"]) == n_new
        near_ties += assert_same_greedy(got[f"q{i}"], theirs, margins)
    shared_blocks = len(tok.encode(system).ids) // 16
    assert shared_blocks >= 1
    assert all(stats[f"q{i}"].device_hit_tokens >= 16 * shared_blocks for i in range(1, 4))
    assert steps["chunked"] > 0 and steps["mixed"] > 0, steps
    record_property("near_ties", near_ties)
    print(f"SmolLM2 engine: {len(prompts)} prompts x {n_new} tokens, steps {steps}, "
          f"prefix hits {[stats[f'q{i}'].device_hit_tokens for i in range(4)]}, "
          f"near-tie divergences: {near_ties}")
    assert near_ties <= 1
