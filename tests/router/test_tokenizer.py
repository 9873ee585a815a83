"""engine/api/tokenizer.py against transformers' AutoTokenizer: same ids, same chat prompt."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.api.tokenizer import ChatTemplateError, Tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello world!"},
        {"role": "assistant", "content": "  Paris.  "},
        {"role": "user", "content": "Tschüß 👋 和平"},
    ],
]
TEXTS = ["Hello world!", "  leading spaces and ünïcödé 👋 和平\n\nnew lines", ""]


def _hf(path: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(path))


@pytest.mark.parametrize("fixture", ["tokenizer_dir", "llama_tokenizer_dir"])
def test_chat_template_matches_transformers(fixture: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(fixture)
    ours, hf = Tokenizer.from_dir(path), _hf(path)
    for messages in CONVERSATIONS:
        for gen in (True, False):
            if fixture == "llama_tokenizer_dir" and messages[-1]["role"] != "user":
                continue
            expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == expected
            ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            assert ours.encode_chat(messages, add_generation_prompt=gen) == list(ids)


def test_encode_decode_match_transformers(tokenizer_dir: Path) -> None:
    ours, hf = Tokenizer.from_dir(tokenizer_dir), _hf(tokenizer_dir)
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == hf.encode(
                text, add_special_tokens=special
            )
        ids = ours.encode(text) + [ours.eos_token_id]
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids)


def test_special_tokens_and_errors(llama_tokenizer_dir: Path, tmp_path: Path) -> None:
    tok = Tokenizer.from_dir(llama_tokenizer_dir)
    assert tok.eos_token_id == tok.token_to_id("<|im_end|>")
    assert tok.bos_token_id == tok.token_to_id("<|im_start|>")
    with pytest.raises(ChatTemplateError, match="must alternate"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="empty"):
        tok.apply_chat_template([])
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_chat_template_jinja_file_wins(tokenizer_dir: Path, tmp_path: Path) -> None:
    import shutil

    shutil.copytree(tokenizer_dir, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m.role }}]{{ m.content | tojson }}{% endfor %}"
    )
    tok = Tokenizer.from_dir(tmp_path / "ckpt")
    assert tok.apply_chat_template([{"role": "user", "content": "é<"}]) == '[user]"é<"'
    assert tok.apply_chat_template([{"role": "user", "content": "é<"}]) == _hf(
        tmp_path / "ckpt"
    ).apply_chat_template([{"role": "user", "content": "é<"}], tokenize=False)


SMOL = Path(os.path.expanduser("~/.cache/kvcache-store/models/SmolLM2-135M-Instruct"))


@pytest.mark.slow
def test_smollm2_checkpoint_matches_transformers() -> None:
    if not (SMOL / "tokenizer.json").is_file():
        pytest.fail(f"{SMOL} missing: run scripts/setup.sh to convert the default model")
    ours, hf = Tokenizer.from_dir(SMOL), _hf(SMOL)
    for messages in CONVERSATIONS:
        assert ours.apply_chat_template(messages) == hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        assert ours.encode_chat(messages) == list(
            hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
        )
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text)


def test_tiny_checkpoint_matches_transformers(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    torch.set_num_threads(1)
    from engine.model.tiny import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "tiny", arch="llama")
    ours, hf = Tokenizer.from_dir(path), _hf(path)
    for messages in CONVERSATIONS:
        assert ours.apply_chat_template(messages) == hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True)
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text)
    # generation_config.json's extra end-of-sequence ids are stop ids too.
    assert set(ours.eos_token_ids) == {hf.convert_tokens_to_ids("<|im_end|>"),
                                       hf.convert_tokens_to_ids("<|endoftext|>")}
