"""OpenAI request validation, error shapes, and response shapes the official client parses."""

from __future__ import annotations

import json

import pytest

from engine.api.generate import TokenLogprob
from router.http.errors import BadRequest, ModelNotFound, ServiceUnavailable, TooManyRequests, Unauthorized
from router.http.openai_responses import SSE_DONE, ResponseFormatter, sse, usage_json
from router.http.openai_types import ChatRequest, CompletionRequest

openai_types = pytest.importorskip("openai.types")
chat_types = pytest.importorskip("openai.types.chat")


def test_completion_request_parses_every_supported_field() -> None:
    req = CompletionRequest.parse({
        "model": "m", "prompt": "Hello", "max_tokens": 7, "temperature": 0, "top_p": 0.5,
        "stop": "\n", "seed": 3, "logprobs": 2, "n": 2, "stream": True,
        "stream_options": {"include_usage": True}, "user": "u", "cache_salt": "tenant-a",
        "top_k": -1, "unknown_extra": 1,
    })
    o = req.options
    assert req.prompts == ("Hello",)
    assert (o.max_tokens, o.temperature, o.top_p, o.stop, o.seed, o.logprobs, o.n) == (7, 0.0, 0.5, ("\n",), 3, 2, 2)
    assert o.stream and o.include_usage and o.cache_salt == "tenant-a" and o.top_k == 0
    s = o.sampling(max_tokens=7, choice=1)
    assert (s.max_tokens, s.temperature, s.seed, s.logprobs) == (7, 0.0, 4, 2)
    assert CompletionRequest.parse({"model": "m", "prompt": [1, 2, 3]}).prompts == ((1, 2, 3),)
    batch = CompletionRequest.parse({"model": "m", "prompt": ["a", [5, 6]]})
    assert batch.prompts == ("a", (5, 6)) and batch.options.max_tokens == 16


def test_unseeded_choices_get_a_seed_at_the_router() -> None:
    # Every worker a choice touches (prefill, decode, a resume) must sample from one
    # (seed, position) stream, so the router fixes the seed when the client gave none.
    o = CompletionRequest.parse({"model": "m", "prompt": "x", "temperature": 0.8}).options
    a, b = o.sampling(max_tokens=4, choice=0), o.sampling(max_tokens=4, choice=1)
    assert a.seed is not None and b.seed is not None and a.seed != b.seed


def test_chat_request_normalizes_messages() -> None:
    req = ChatRequest.parse({
        "model": "m", "max_completion_tokens": 5, "logprobs": True, "top_logprobs": 3,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None, "name": None},
        ],
    })
    assert req.messages[1]["content"] == "a\nb"
    assert req.messages[2] == {"role": "assistant", "content": ""}
    assert req.options.max_tokens == 5 and req.options.logprobs == 3
    assert ChatRequest.parse({"model": "m", "messages": [{"role": "user", "content": "x"}]}).options.max_tokens is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x"}, "model"),
        ({"model": "m"}, "prompt"),
        ({"model": "m", "prompt": ""}, "prompt"),
        ({"model": "m", "prompt": [1, "a"]}, "prompt"),
        ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "prompt": "x", "max_tokens": "5"}, "max_tokens"),
        ({"model": "m", "prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"model": "m", "prompt": "x", "temperature": 3}, "temperature"),
        ({"model": "m", "prompt": "x", "temperature": "hot"}, "temperature"),
        ({"model": "m", "prompt": "x", "top_p": 0}, "top_p"),
        ({"model": "m", "prompt": "x", "n": 0}, "n"),
        ({"model": "m", "prompt": "x", "logprobs": 6}, "logprobs"),
        ({"model": "m", "prompt": "x", "stop": [1]}, "stop"),
        ({"model": "m", "prompt": "x", "stream": "yes"}, "stream"),
        ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"model": "m", "prompt": "x", "echo": True}, "echo"),
        ({"model": "m", "prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
        ({"model": "m", "prompt": "x", "best_of": 3}, "best_of"),
        ({"model": "m", "prompt": "x", "seed": 1.5}, "seed"),
    ],
)
def test_completion_bad_input_names_the_field(body: dict, param: str) -> None:
    with pytest.raises(BadRequest) as info:
        CompletionRequest.parse(body)
    err = info.value.to_json()["error"]
    assert info.value.status == 400 and err["param"] == param and err["type"] == "invalid_request_error"
    assert err["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": "hi"}, "messages"),
        ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"model": "m", "messages": [{"role": "user"}]}, "messages[0].content"),
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
         "top_logprobs"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ],
)
def test_chat_bad_input_names_the_field(body: dict, param: str) -> None:
    with pytest.raises(BadRequest) as info:
        ChatRequest.parse(body)
    assert info.value.param == param


def test_error_statuses_and_shape() -> None:
    assert BadRequest("x").status == 400
    assert Unauthorized().status == 401
    err = ModelNotFound("gpt-9", ["tiny"])
    assert err.status == 404 and err.to_json()["error"]["code"] == "model_not_found"
    assert "tiny" in err.message
    assert TooManyRequests("busy").status == 429
    assert ServiceUnavailable("no worker").status == 503
    assert set(ServiceUnavailable("x").to_json()["error"]) == {"message", "type", "param", "code"}


def test_completion_shapes_parse_with_the_openai_client(tokenizer) -> None:
    fmt = ResponseFormatter("completion", "tiny", tokenizer)
    ids = tokenizer.encode("Hello world", add_special_tokens=False)
    lps = [TokenLogprob(-0.5, ((t, -0.5), (1, -2.0))) for t in ids]
    logprobs = fmt.logprobs(ids, lps)
    body = fmt.response([fmt.choice(1, "b", "length"), fmt.choice(0, "Hello world", "stop", logprobs)],
                        usage_json(3, 4))
    parsed = openai_types.Completion.model_validate(body)
    assert [c.index for c in parsed.choices] == [0, 1]
    assert parsed.usage.total_tokens == 7 and parsed.id.startswith("cmpl-")
    assert "".join(parsed.choices[0].logprobs.tokens) == "Hello world"
    assert parsed.choices[0].logprobs.text_offset[0] == 0
    chunk = sse(fmt.chunk(0, "Hel"))
    assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n")
    # OpenAI streams finish_reason null until the end; its client builds chunks unvalidated.
    streamed = json.loads(chunk[6:])
    assert streamed["choices"] == [{"index": 0, "text": "Hel", "logprobs": None, "finish_reason": None}]
    openai_types.Completion.model_validate(fmt.chunk(0, "lo", "length"))
    openai_types.Completion.model_validate(fmt.usage_chunk(usage_json(1, 2)))
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_chat_shapes_parse_with_the_openai_client(tokenizer) -> None:
    fmt = ResponseFormatter("chat", "tiny", tokenizer)
    ids = tokenizer.encode("Paris", add_special_tokens=False)
    lps = [TokenLogprob(-0.1, ((t, -0.1),)) for t in ids]
    body = fmt.response([fmt.choice(0, "Paris", "stop", fmt.logprobs(ids, lps))], usage_json(5, 2, cached_tokens=4))
    parsed = chat_types.ChatCompletion.model_validate(body)
    assert parsed.choices[0].message.content == "Paris" and parsed.object == "chat.completion"
    assert "".join(e.token for e in parsed.choices[0].logprobs.content) == "Paris"
    assert parsed.usage.prompt_tokens_details.cached_tokens == 4
    for obj in (fmt.role_chunk(0), fmt.chunk(0, "Pa"), fmt.chunk(0, "", "stop"), fmt.usage_chunk(usage_json(1, 1))):
        chunk = chat_types.ChatCompletionChunk.model_validate(obj)
        assert chunk.id == fmt.id
    assert fmt.role_chunk(0)["choices"][0]["delta"]["role"] == "assistant"
    assert fmt.chunk(0, "", "stop")["choices"][0]["delta"] == {}


def test_null_fields_are_absent_ones() -> None:
    o = CompletionRequest.parse({"model": "m", "prompt": "x", "temperature": None, "n": None,
                                 "stop": None, "seed": None, "max_tokens": None}).options
    assert (o.temperature, o.n, o.stop, o.seed) == (1.0, 1, (), None)
    assert o.max_tokens is None           # an explicit null: up to the context, as before
    assert CompletionRequest.parse({"model": "m", "prompt": "x"}).options.max_tokens == 16


def test_placement_and_worker_errors_map_to_statuses_in_one_place() -> None:
    from router.http.errors import OpenAIError, openai_error
    from router.placement.errors import NoCapacity
    from router.workers.client import KeyMismatch, WorkerRejected, WorkerUnavailable

    cases = [(NoCapacity("none"), 503), (KeyMismatch("w", 409, "keys"), 500),
             (WorkerRejected("w", 400, "bad"), 400), (WorkerUnavailable("w", "gone"), 503),
             (BadRequest("x"), 400)]
    for exc, status in cases:
        err = openai_error(exc)
        assert isinstance(err, OpenAIError) and err.status == status, exc
    assert "disagree on the prompt's block keys" in openai_error(KeyMismatch("w", 409, "k")).message
    assert openai_error(ValueError("a bug")) is None


# --- what the standard load generators send (GuideLLM 0.8.1, AIPerf 0.13.0, vllm bench serve) --

CONTINUOUS_USAGE = {"include_usage": True, "continuous_usage_stats": True}


def test_continuous_usage_stats_is_accepted_with_vllms_meaning() -> None:
    """vLLM: usage in every chunk, but only together with include_usage."""
    def options(stream_options: dict) -> object:
        return CompletionRequest.parse({"model": "m", "prompt": "x", "stream": True,
                                        "stream_options": stream_options}).options

    o = options(CONTINUOUS_USAGE)
    assert o.include_usage and o.continuous_usage
    o = options({"include_usage": False, "continuous_usage_stats": True})
    assert not o.include_usage and not o.continuous_usage
    o = options({"include_usage": True, "continuous_usage_stats": None})
    assert o.include_usage and not o.continuous_usage
    assert not options({"include_usage": True}).continuous_usage
    chat = ChatRequest.parse({"model": "m", "messages": [{"role": "user", "content": "x"}],
                              "stream": True, "stream_options": CONTINUOUS_USAGE})
    assert chat.options.continuous_usage


@pytest.mark.parametrize(
    ("stream_options", "stream", "param"),
    [
        ({"include_usage": True, "continuous_usage_stats": "yes"}, True,
         "stream_options.continuous_usage_stats"),
        ({"include_usage": True, "continuous_usage_stats": 1}, True,
         "stream_options.continuous_usage_stats"),
        (CONTINUOUS_USAGE, False, "stream_options"),
    ],
)
def test_continuous_usage_stats_bad_input_names_the_field(stream_options: dict, stream: bool,
                                                          param: str) -> None:
    for body in ({"model": "m", "prompt": "x"},
                 {"model": "m", "messages": [{"role": "user", "content": "x"}]}):
        with pytest.raises(BadRequest) as info:
            (ChatRequest if "messages" in body else CompletionRequest).parse(
                {**body, "stream": stream, "stream_options": stream_options})
        assert info.value.param == param


def test_chat_max_completion_tokens_wins_over_max_tokens() -> None:
    """vLLM's rule: max_completion_tokens when given, else the deprecated max_tokens."""
    def max_tokens(**fields: object) -> int | None:
        return ChatRequest.parse({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                  **fields}).options.max_tokens

    assert max_tokens(max_completion_tokens=5, max_tokens=9) == 5
    assert max_tokens(max_completion_tokens=None, max_tokens=9) == 9
    assert max_tokens(max_tokens=9) == 9
    assert max_tokens(max_completion_tokens=5) == 5
    with pytest.raises(BadRequest) as info:
        max_tokens(max_completion_tokens=0)
    assert info.value.param == "max_completion_tokens"


def test_completions_ignore_max_completion_tokens_as_vllm_does() -> None:
    # vLLM's CompletionRequest has no such field: it is ignored there, and here (named in the log).
    req = CompletionRequest.parse({"model": "m", "prompt": "x", "max_completion_tokens": 5})
    assert req.options.max_tokens == 16 and req.ignored == ("max_completion_tokens",)


def test_stop_null_is_no_stop_and_ignore_eos_reaches_the_worker() -> None:
    for req in (CompletionRequest.parse({"model": "m", "prompt": "x", "stop": None,
                                         "ignore_eos": True}),
                ChatRequest.parse({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                   "stop": None, "ignore_eos": True})):
        assert req.options.stop == () and req.options.ignore_eos
        assert req.options.sampling(max_tokens=4).ignore_eos
    assert not CompletionRequest.parse({"model": "m", "prompt": "x"}).options.sampling(4).ignore_eos
    with pytest.raises(BadRequest) as info:
        CompletionRequest.parse({"model": "m", "prompt": "x", "ignore_eos": "true"})
    assert info.value.param == "ignore_eos"


@pytest.mark.parametrize(
    "body",
    [
        # GuideLLM 0.8.1, /v1/completions and /v1/chat/completions, synthetic data of fixed
        # lengths (its code also sets "stop": null, which is not on the wire)
        {"model": "m", "stream": True, "stream_options": CONTINUOUS_USAGE, "max_tokens": 8,
         "ignore_eos": True, "prompt": "hello"},
        {"model": "m", "stream": True, "stream_options": CONTINUOUS_USAGE,
         "max_completion_tokens": 8, "ignore_eos": True,
         "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]},
        # vllm bench serve 0.32 (the openai and openai-chat backends, --ignore-eos)
        {"model": "m", "prompt": "hello", "repetition_penalty": 1.0, "max_tokens": 8,
         "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
         "ignore_eos": True},
        {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
         "max_completion_tokens": 8, "stream": True, "stream_options": {"include_usage": True},
         "ignore_eos": True},
        # AIPerf 0.13.0 (chat with --per-chunk-usage, completions; --extra-inputs ignore_eos:true)
        {"messages": [{"role": "user", "content": "hello"}], "model": "m", "stream": True,
         "max_completion_tokens": 8, "ignore_eos": True, "stream_options": CONTINUOUS_USAGE},
        {"prompt": "hello", "model": "m", "stream": True, "max_tokens": 8, "ignore_eos": True,
         "stream_options": {"include_usage": True}},
    ],
)
def test_load_generator_bodies_parse_with_nothing_ignored(body: dict) -> None:
    req = (ChatRequest if "messages" in body else CompletionRequest).parse(body)
    assert req.ignored == () and req.options.max_tokens == 8 and req.options.stream
    assert req.options.ignore_eos and req.options.include_usage


def _sse_objects(text: str) -> list[dict]:
    lines = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_continuous_usage_is_in_every_streamed_chunk(tokenizer_dir, tokenizer) -> None:
    """vLLM's continuous_usage_stats: every chunk of choice i carries its prompt's tokens and
    the tokens choice i generated so far (a chat's role chunk: 0); the last chunk, with empty
    choices, has the whole request's usage. Without the option no chunk but that one has it."""
    import httpx

    from tests.router.test_app import _fake, _router, _run

    async def body() -> None:
        fake = await _fake(tokenizer)
        answer = len(fake.script or [])
        async with _router(tokenizer_dir, [fake]) as url, httpx.AsyncClient(base_url=url) as http:
            prompts = ["Hello world!", "What is the capital of France?"]
            lens = [len(tokenizer.encode(p)) for p in prompts]
            r = await http.post("/v1/completions", json={
                "model": "tiny", "prompt": prompts, "n": 2, "max_tokens": 50, "stream": True,
                "stop": None, "ignore_eos": True, "stream_options": CONTINUOUS_USAGE})
            chunks = _sse_objects(r.text)
            *deltas, last = chunks
            assert last["choices"] == [] and last["usage"]["prompt_tokens"] == sum(lens)
            assert last["usage"]["completion_tokens"] == 4 * answer
            seen = {i: 0 for i in range(4)}
            for c in deltas:
                (choice,) = c["choices"]
                i, usage = choice["index"], c["usage"]
                assert usage["completion_tokens"] >= seen[i]       # so far: never less
                seen[i] = usage["completion_tokens"]
                assert usage["prompt_tokens"] == lens[i // 2]
                assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
                if choice["finish_reason"] is not None:
                    assert usage["completion_tokens"] == answer
            assert seen == {i: answer for i in range(4)}

            messages = [{"role": "user", "content": "What is the capital of France?"}]
            r = await http.post("/v1/chat/completions", json={
                "model": "tiny", "messages": messages, "max_completion_tokens": 5,
                "stream": True, "stream_options": CONTINUOUS_USAGE})
            role, *deltas, last = _sse_objects(r.text)
            n_prompt = len(tokenizer.encode_chat(messages))
            assert role["choices"][0]["delta"]["role"] == "assistant"
            assert role["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 0,
                                     "total_tokens": n_prompt}
            assert deltas and all("usage" in c for c in deltas)
            assert deltas[-1]["choices"][0]["finish_reason"] == "length"
            assert deltas[-1]["usage"]["completion_tokens"] == 5
            assert last["choices"] == [] and last["usage"]["completion_tokens"] == 5

            # include_usage alone: only the last chunk has usage (and it is OpenAI's shape)
            r = await http.post("/v1/chat/completions", json={
                "model": "tiny", "messages": messages, "max_tokens": 5, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": False}})
            *rest, last = _sse_objects(r.text)
            assert not any("usage" in c for c in rest) and last["usage"]["completion_tokens"] == 5
            for c in (role, *deltas, last):
                chat_types.ChatCompletionChunk.model_validate(c)
        await fake.stop()

    _run(body)


def test_tokenize_and_detokenize_as_vllm(tokenizer_dir, tokenizer) -> None:
    """vLLM's /tokenize (a prompt, or messages through the chat template) and /detokenize:
    ``vllm bench serve`` checks its prompts against the server's tokenizer with them."""
    import httpx

    from tests.router.test_app import _fake, _router, _run

    async def body() -> None:
        fake = await _fake(tokenizer)
        async with _router(tokenizer_dir, [fake]) as url, httpx.AsyncClient(base_url=url) as http:
            text = "What is the capital of France?"
            r = await http.post("/tokenize", json={"model": "tiny", "prompt": text,
                                                   "add_special_tokens": False})
            ids = tokenizer.encode(text, add_special_tokens=False)
            assert r.status_code == 200
            assert r.json() == {"count": len(ids), "max_model_len": 256, "tokens": ids}
            r = await http.post("/tokenize", json={"prompt": text, "return_token_strs": True})
            assert r.json()["tokens"] == tokenizer.encode(text)     # special tokens by default
            assert r.json()["token_strs"] == [tokenizer.id_to_token(t) for t in r.json()["tokens"]]
            messages = [{"role": "user", "content": text}]
            r = await http.post("/tokenize", json={"model": "tiny", "messages": messages})
            assert r.json()["tokens"] == tokenizer.encode_chat(messages)
            r = await http.post("/detokenize", json={"model": "tiny", "tokens": ids})
            assert r.status_code == 200 and r.json() == {"prompt": text}

            for path, bad, param in [
                ("/tokenize", {"model": "tiny"}, None),
                ("/tokenize", {"prompt": "x", "messages": messages}, None),
                ("/tokenize", {"prompt": 5}, "prompt"),
                ("/tokenize", {"messages": messages, "continue_final_message": True},
                 "continue_final_message"),
                ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
                ("/detokenize", {"tokens": [tokenizer.vocab_size]}, "tokens"),
            ]:
                r = await http.post(path, json=bad)
                assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, bad)
            r = await http.post("/tokenize", json={"model": "gpt-9", "prompt": "x"})
            assert r.status_code == 404
        await fake.stop()

    _run(body)
