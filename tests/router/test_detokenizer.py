"""Incremental detokenization: UTF-8 split across tokens, stop strings across tokens."""

from __future__ import annotations

from router.detokenizer import IncrementalDetokenizer, normalize_stop

TEXT = "Hello world! Tschüß 👋 和平 — the quick brown fox."


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    pieces = [detok.push([t]).text for t in ids]
    pieces.append(detok.flush())
    return pieces


def test_multibyte_characters_split_across_tokens_are_emitted_whole(tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    # The tiny vocabulary has no merges for these characters: they arrive as single bytes.
    assert len(ids) > len(TEXT) // 2
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids), "test needs split characters"
    pieces = _stream(IncrementalDetokenizer(tokenizer, [1, 2, 3]), ids)
    assert "".join(pieces) == TEXT
    assert not any("\ufffd" in p for p in pieces)
    # Text is emitted as soon as it is complete: an ASCII token never waits.
    assert pieces[0] == tokenizer.decode(ids[:1])


def test_chunks_of_several_tokens_and_special_tokens(tokenizer) -> None:
    ids = tokenizer.encode(TEXT, add_special_tokens=False) + [tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer)
    text = "".join(detok.push(ids[i : i + 3]).text for i in range(0, len(ids), 3)) + detok.flush()
    assert text == TEXT  # the special end token is skipped
    assert detok.num_tokens == len(ids)


def test_stop_string_across_token_boundaries_is_cut_and_held_back(tokenizer) -> None:
    text = "What is the capital of France? Paris is the capital."
    ids = tokenizer.encode(text, add_special_tokens=False)
    stop = "capital of Fr"
    detok = IncrementalDetokenizer(tokenizer, stop=[stop, "zzz"])
    emitted = ""
    for n, t in enumerate(ids, 1):
        delta = detok.push([t])
        emitted += delta.text
        # Never emit anything a stop string could still start with.
        assert "capi" not in emitted and "cap" not in emitted[-3:]
        if delta.stopped:
            break
    assert delta.stop_str == stop and detok.stopped
    assert emitted == "What is the " == detok.text
    assert n < len(ids)
    # After a stop nothing more comes out.
    assert detok.push(ids[n:]).text == "" and detok.flush() == ""


def test_stop_inside_one_multi_token_push_reports_consumed_tokens(tokenizer) -> None:
    text = "Hello world! The quick brown fox jumps."
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=["quick"], include_stop_str_in_output=True)
    delta = detok.push(ids)
    assert delta.stopped and delta.text == "Hello world! The quick"
    consumed = ids[: delta.num_tokens]
    assert "quick" in tokenizer.decode(consumed) and "quick" not in tokenizer.decode(consumed[:-1])


def test_held_back_prefix_released_when_it_does_not_become_a_stop(tokenizer) -> None:
    ids = tokenizer.encode("the quick brown", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=["brown cow"])
    streamed = "".join(detok.push([t]).text for t in ids)
    assert streamed == "the quick "  # "brown" might still become "brown cow"
    assert detok.flush() == "brown" and not detok.stopped
    assert detok.text == "the quick brown"


def test_normalize_stop() -> None:
    assert normalize_stop(None) == ()
    assert normalize_stop("x") == ("x",)
    assert normalize_stop(["a", "", "a", "b"]) == ("a", "b")


def test_fallback_when_the_stream_decoder_fails(tokenizer) -> None:
    class Broken:
        def step(self, _tok, _id):
            raise RuntimeError("InvalidPrefix")

    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    head = "".join(detok.push([t]).text for t in ids[:5])
    detok._stream = Broken()  # the decoder breaks mid-stream: the rest still comes out right
    pieces = [detok.push([t]).text for t in ids[5:]] + [detok.flush()]
    assert head + "".join(pieces) == TEXT
    assert not any("\ufffd" in p for p in pieces)
