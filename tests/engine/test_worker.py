"""EngineWorker in-process: what a client sees when the engine thread dies."""

from __future__ import annotations

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
