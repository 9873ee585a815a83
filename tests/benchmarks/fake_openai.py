"""A fake streaming ``/v1/completions`` server with known delays, for testing the load client.

It is not our router: it answers every request with ``max_tokens`` chunks of text ``"x"``, the
first ``ttft_s`` after the request arrives and each next one ``tpot_s`` later, then a
finish-only chunk, a usage chunk and ``data: [DONE]``. A prompt whose first token id is
``FAIL_500`` gets HTTP 500; one starting with ``DROP`` loses its connection after two tokens;
one starting with ``SILENT`` sends no text at all, only the finish (as a router does with
tokens whose text is empty).
It runs on its own event loop in a thread, so a test can drive it with ``asyncio.run``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

FAIL_500 = 1
DROP = 2
SILENT = 3


@dataclass
class FakeOpenAI:
    ttft_s: float = 0.1
    tpot_s: float = 0.02
    model: str = "fake-model"
    received: list[tuple[float, dict[str, Any]]] = field(default_factory=list)  # (perf_counter, body)
    url: str = ""

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        arrived = time.perf_counter()
        body = await request.json()
        self.received.append((arrived, body))
        prompt = body["prompt"]
        if prompt[0] == FAIL_500:
            return web.json_response({"error": {"message": "boom", "type": "server_error"}}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = body["max_tokens"]

        async def send(obj: dict[str, Any]) -> None:
            await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

        def chunk(text: str, finish: str | None = None) -> dict[str, Any]:
            return {"id": "cmpl-1", "object": "text_completion", "model": self.model,
                    "choices": [{"index": 0, "text": text, "finish_reason": finish}]}

        for i in range(n):
            # sleep to an absolute deadline so the delays do not accumulate drift
            due = arrived + self.ttft_s + i * self.tpot_s
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            if prompt[0] == DROP and i == 2:
                request.transport.close()
                return resp
            if prompt[0] != SILENT:
                await send(chunk("x"))
        await send(chunk("", "length"))
        if (body.get("stream_options") or {}).get("include_usage"):
            await send({"id": "cmpl-1", "object": "text_completion", "choices": [],
                        "usage": {"prompt_tokens": len(prompt), "completion_tokens": n,
                                  "total_tokens": len(prompt) + n,
                                  "prompt_tokens_details": {"cached_tokens": 0}}})
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        return app

    def __enter__(self) -> "FakeOpenAI":
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self._loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(self.app(), handler_cancellation=True)
        started = threading.Event()

        def serve() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._runner.setup())
            self._loop.run_until_complete(web.SockSite(self._runner, sock).start())
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()
        assert started.wait(10), "fake server did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


def main() -> None:
    """``python -m tests.benchmarks.fake_openai --port P``: serve until SIGTERM (for ``sweep --launch``)."""
    import argparse
    import signal

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ttft", type=float, default=0.05)
    parser.add_argument("--tpot", type=float, default=0.01)
    args = parser.parse_args()
    fake = FakeOpenAI(args.ttft, args.tpot)

    async def serve() -> None:
        runner = web.AppRunner(fake.app(), handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", args.port).start()
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        await runner.cleanup()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
