"""Incremental detokenization: UTF-8 split across tokens, stop strings across tokens."""

from __future__ import annotations

import random

import pytest

from engine.api.tokenizer import Tokenizer
from router.text.detokenizer import IncrementalDetokenizer, normalize_stop

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


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """The tiny test model's byte-level tokenizer (engine/model/tiny.py): most non-ASCII characters
    are single-byte tokens, so random ids split characters everywhere."""
    from engine.model.tiny import make_tiny_checkpoint

    return Tokenizer.from_dir(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama", seed=0))


def _byte_heavy_ids(tok: Tokenizer, rng: random.Random, n: int) -> list[int]:
    """``n`` random ids, half of them tokens whose text alone is not whole characters (lone
    UTF-8 lead and continuation bytes), some special tokens."""
    vocab = range(tok.vocab_size)
    partial = [i for i in vocab if "\ufffd" in tok.decode([i], skip_special_tokens=False)]
    special = [t for t in (tok.token_to_id(s) for s in ("<|endoftext|>", "<|im_start|>")) if t is not None]
    pools = [partial, list(vocab), special]
    return [rng.choice(rng.choices(pools, weights=[10, 9, 1])[0]) for _ in range(n)]


@pytest.mark.parametrize("skip_special", [True, False])
def test_stream_equals_decode_of_random_ids(tiny_tokenizer: Tokenizer, skip_special: bool) -> None:
    """The contract, over random sequences: prompts that end in half a character, outputs
    that start and end in one, chunks of any size, special tokens kept or skipped."""
    tok, rng = tiny_tokenizer, random.Random(1234 + skip_special)
    for case in range(400):
        prompt = _byte_heavy_ids(tok, rng, rng.randint(0, 8))
        output = _byte_heavy_ids(tok, rng, rng.randint(1, 24))
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special)
        pieces, i = [], 0
        while i < len(output):
            step = rng.randint(1, 4)
            delta = detok.push(output[i:i + step])
            assert delta.num_tokens == len(output[i:i + step]) and not delta.stopped
            pieces.append(delta.text)
            i += step
        streamed = "".join(pieces)
        pieces.append(detok.flush())
        expect = tok.decode(output, skip_special_tokens=skip_special)
        assert "".join(pieces) == expect == detok.text, (case, prompt, output)
        # Streamed text is stable: never a character still waiting for its bytes.
        assert expect.startswith(streamed) and not streamed.endswith("\ufffd"), (case, prompt, output)


def test_a_half_character_ending_the_prompt_is_not_joined_to_the_output(tiny_tokenizer) -> None:
    tok = tiny_tokenizer
    euro = tok.encode("€", add_special_tokens=False)       # 3 byte tokens: e2 82 ac
    assert len(euro) == 3
    prompt = tok.encode("Price: ", add_special_tokens=False) + euro[:1]
    output = euro[1:] + tok.encode(" each", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt)
    text = "".join(detok.push([t]).text for t in output) + detok.flush()
    assert text == tok.decode(output) == "\ufffd\ufffd each"


def test_a_character_cut_off_by_the_end_is_flushed_as_decode_gives_it(tiny_tokenizer) -> None:
    tok = tiny_tokenizer
    output = tok.encode("ok 👋", add_special_tokens=False)[:-1]
    detok = IncrementalDetokenizer(tok, tok.encode("say", add_special_tokens=False))
    streamed = "".join(detok.push([t]).text for t in output)
    assert streamed == "ok "
    assert detok.flush() == "\ufffd" and detok.text == tok.decode(output)


def test_a_stop_string_in_the_flushed_rest_still_stops(tiny_tokenizer) -> None:
    tok = tiny_tokenizer
    output = tok.encode("abc 👋", add_special_tokens=False)[:-1]
    detok = IncrementalDetokenizer(tok, stop=["c \ufffd"])
    assert "".join(detok.push([t]).text for t in output) == "ab"   # "c " might start the stop
    assert detok.flush() == "" and detok.stop_str == "c \ufffd" and detok.text == "ab"


def test_sentencepiece_style_first_token_keeps_its_space_in_context() -> None:
    """The contract's one exception: a Metaspace decoder strips the first token's space when
    it decodes the output alone; in the prompt's context the continuation keeps it."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE(unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.decoder = decoders.Metaspace()
    hf.train_from_iterator(["The capital of France is Paris. Paris is nice."] * 5,
                           trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"],
                                               show_progress=False))
    tok = Tokenizer(hf)
    prompt, output = tok.encode("The capital of France is"), tok.encode("Paris is nice.")
    detok = IncrementalDetokenizer(tok, prompt)
    text = "".join(detok.push([t]).text for t in output) + detok.flush()
    assert text == " Paris is nice." and tok.decode(output) == "Paris is nice."
    no_context = IncrementalDetokenizer(tok)
    assert "".join(no_context.push([t]).text for t in output) + no_context.flush() == "Paris is nice."
