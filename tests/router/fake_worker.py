"""A fake worker speaking the worker HTTP API (aiohttp, in the test's own loop), for unit
tests of the router's client, pool, orchestrator and app. It generates ``prompt[-1] + 1, + 2,
...`` (or ``script``); a ``phase="prefill"`` request gets the first token only, as a real
prefill worker's handoff."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from engine.api.events import (
    BlockEvent,
    LoadEvent,
    LoadFigures,
    Snapshot,
)
from engine.api.generate import (
    GenerateFinal,
    GenerateRequest,
    RequestStats,
    WorkerInfo,
)

NS = bytes(16)


class FakeWorker:
    def __init__(self, worker_id: str = "w0", role: str = "colocated") -> None:
        self.worker_id, self.role = worker_id, role
        self.blocks: set[bytes] = set()
        self.events: list[dict[str, Any]] = []
        self.seq = 0
        self.load = LoadFigures(kv_free_blocks=100, kv_total_blocks=100)
        self.aborted: list[str] = []
        self.requests: list[GenerateRequest] = []
        self.break_after: int | None = None   # end a generate stream after N tokens, unfinished
        self.snapshots = 0
        self.script: list[int] | None = None  # ids to generate (default: prompt[-1] + 1, ...)
        self.token_delay = 0.0
        self.stats: RequestStats | None = None   # the final line's stats (default: below)
        self.in_progress: set[str] = set()
        self.authorization: list[str | None] = []   # each call's Authorization header
        self._cond = asyncio.Condition()
        self._closing = False
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def info(self) -> WorkerInfo:
        return WorkerInfo(self.worker_id, f"http://127.0.0.1:{self.port}", self.role,  # type: ignore[arg-type]
                          "tiny", NS, 4, 100, 256)

    async def start(self) -> FakeWorker:
        app = web.Application()
        app.router.add_get("/snapshot", self._snapshot)
        app.router.add_get("/events", self._events)
        app.router.add_post("/generate", self._generate)
        app.router.add_post("/abort", self._abort)
        app.router.add_get("/info", self._info)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        async with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._runner is not None:
            await self._runner.cleanup()

    async def publish(self, kind: str, keys=(), load: LoadFigures | None = None, skip: int = 0) -> None:
        """Record an event; ``skip`` > 0 leaves a gap in the sequence before it."""
        async with self._cond:
            self.seq += 1 + skip
            if kind == "load":
                self.load = load or self.load
                self.events.append(LoadEvent(self.seq, self.load).to_json())
            else:
                (self.blocks.update if kind == "stored" else self.blocks.difference_update)(keys)
                self.events.append(BlockEvent(self.seq, kind, tuple(keys)).to_json())  # type: ignore[arg-type]
            self._cond.notify_all()

    async def _snapshot(self, req: web.Request) -> web.Response:
        self.authorization.append(req.headers.get("Authorization"))
        self.snapshots += 1
        return web.json_response(Snapshot(self.seq, tuple(self.blocks), self.load).to_json())  # type: ignore[arg-type]

    async def _events(self, req: web.Request) -> web.StreamResponse:
        since = int(req.query.get("since", "0"))
        resp = web.StreamResponse()
        await resp.prepare(req)
        sent = since
        while not self._closing:
            async with self._cond:
                await self._cond.wait_for(lambda: self.seq > sent or self._closing)
                pending = [e for e in self.events if e["seq"] > sent]
            for e in pending:
                await resp.write(json.dumps(e).encode() + b"\n")
                sent = e["seq"]
        return resp

    async def _generate(self, req: web.Request) -> web.StreamResponse:
        self.authorization.append(req.headers.get("Authorization"))
        try:
            gen = GenerateRequest.from_json(await req.json())
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        self.requests.append(gen)
        resp = web.StreamResponse()
        await resp.prepare(req)
        start = len(gen.output_token_ids)
        reason = "length"
        self.in_progress.add(gen.request_id)
        try:
            end = start + 1 if gen.phase == "prefill" else gen.sampling.max_tokens
            for i in range(start, min(end, gen.sampling.max_tokens)):
                if self.break_after is not None and i - start >= self.break_after:
                    return resp  # the stream ends without its final line
                if self.script is not None and i >= len(self.script):
                    reason = "stop"
                    break
                token = self.script[i] if self.script is not None else gen.prompt_token_ids[-1] + 1 + i
                line: dict = {"token_ids": [token]}
                if gen.sampling.logprobs is not None:
                    top = [[token, -0.25]][: gen.sampling.logprobs]
                    line["logprobs"] = [{"logprob": -0.25, "top": top}]
                await resp.write(json.dumps(line).encode() + b"\n")
                await asyncio.sleep(self.token_delay)
            if self.break_after is not None and min(end, gen.sampling.max_tokens) - start <= self.break_after \
                    and reason == "length":
                return resp  # every token sent, but not the final line
        finally:
            self.in_progress.discard(gen.request_id)
        stats = self.stats or RequestStats(computed_prompt_tokens=len(gen.prompt_token_ids),
                                           device_hit_tokens=4, prefill_s=0.01)
        final = GenerateFinal(reason, stats)  # type: ignore[arg-type]
        await resp.write(json.dumps(final.to_json()).encode() + b"\n")
        return resp

    async def _info(self, _req: web.Request) -> web.Response:
        return web.json_response(self.info.to_json())

    async def _abort(self, req: web.Request) -> web.Response:
        self.authorization.append(req.headers.get("Authorization"))
        self.aborted.append((await req.json())["request_id"])
        return web.json_response({"ok": True})
