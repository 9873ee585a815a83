"""EngineWorker in-process: what a client sees when the engine thread dies; its step trace."""

from __future__ import annotations

import io
import json
import threading

import pytest
from fastapi.testclient import TestClient

from engine.api.generate import GenerateChunk, GenerateFinal, GenerateRequest, SamplingParams, WorkerInfo
from engine.core.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.model.runner import ModelRunner, StepItem
from engine.worker.events import EventStream
from engine.worker.metrics import WorkerMetrics
from engine.worker.server import create_app
from engine.worker.worker import EngineWorker, MeasuredRunner


class Boom(RuntimeError):
    pass


def test_a_dead_engine_thread_ends_requests_and_health_says_dead(tiny_llama_dir, monkeypatch):
    inner = ModelRunner(tiny_llama_dir, num_blocks=16, block_size=16)

    def execute(items: list[StepItem]):
        raise Boom("the model failed")

    monkeypatch.setattr(inner, "execute", execute)
    runner = MeasuredRunner(inner)
    engine = LLMEngine(runner, EngineConfig(num_blocks=16, block_size=16))
    events, metrics = EventStream(64), WorkerMetrics()
    worker = EngineWorker(engine, runner, events, metrics, load_interval_s=0.05).start()
    info = WorkerInfo(worker_id="w", address="http://x", role="colocated", model="tiny",
                      namespace=engine.namespace, block_size=16, kv_capacity_blocks=16,
                      max_model_len=engine.max_model_len)
    got: list[GenerateChunk | GenerateFinal] = []
    done = threading.Event()

    def sink(item: GenerateChunk | GenerateFinal) -> None:
        got.append(item)
        if isinstance(item, GenerateFinal):
            done.set()

    request = GenerateRequest("r", [3, 4, 5], sampling=SamplingParams(max_tokens=4, temperature=0))
    worker.submit(request, sink).result(timeout=30)
    assert done.wait(30) and isinstance(got[-1], GenerateFinal)
    assert got[-1].finish_reason == "abort"
    assert isinstance(worker.error, Boom) and not worker.alive
    with pytest.raises(RuntimeError, match="engine thread has stopped"):
        worker.submit(GenerateRequest("r2", [3], sampling=SamplingParams(max_tokens=1)), sink)
    with TestClient(create_app(worker, info, events, metrics)) as http:
        r = http.get("/health")
    assert r.status_code == 503
    assert r.json()["status"] == "dead" and "the model failed" in r.json()["error"]
    worker.stop()


def test_the_step_trace_has_a_line_per_step_with_its_items(tiny_llama_dir):
    """A 20-token prompt and 4 tokens: one prefill step ``[20, 0]`` then decodes ``[1, ctx]``
    over growing contexts, each with its wall time and the model's (smaller) share."""
    runner = MeasuredRunner(ModelRunner(tiny_llama_dir, num_blocks=16, block_size=16))
    engine = LLMEngine(runner, EngineConfig(num_blocks=16, block_size=16))
    trace = io.StringIO()
    worker = EngineWorker(engine, runner, EventStream(64), WorkerMetrics(), step_trace=trace).start()
    done = threading.Event()
    request = GenerateRequest("r", list(range(3, 23)), sampling=SamplingParams(max_tokens=4, temperature=0))
    worker.submit(request, lambda item: done.set() if isinstance(item, GenerateFinal) else None).result(30)
    assert done.wait(30)
    worker.stop()
    lines = [json.loads(x) for x in trace.getvalue().splitlines()]
    assert [x["items"] for x in lines] == [[[20, 0]], [[1, 20]], [[1, 21]], [[1, 22]]]
    assert all(0 < x["execute_s"] <= x["step_s"] for x in lines)
