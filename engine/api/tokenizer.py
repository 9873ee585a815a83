"""Torch-free tokenizer wrapper and chat template, shared by the engine and the router.

``Tokenizer.from_dir(model_dir)`` reads a Hugging Face checkpoint's ``tokenizer.json`` (through
the ``tokenizers`` library), ``tokenizer_config.json`` (special tokens, chat template),
``chat_template.jinja`` (which wins over the config's template, as in transformers) and
``generation_config.json`` (extra end-of-sequence ids).

Contract: ``encode`` equals transformers' fast tokenizer ``encode`` and
``apply_chat_template(messages, add_generation_prompt)`` equals transformers'
``apply_chat_template(messages, tokenize=False, add_generation_prompt=...)`` character for
character: the template runs in the same sandboxed Jinja environment (``trim_blocks``,
``lstrip_blocks``, ``loopcontrols``, HF's ``tojson``, ``raise_exception``, ``strftime_now``)
with the special tokens in scope. Chat prompts are encoded with ``add_special_tokens=False``
(the template already holds them): use ``encode_chat``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

__all__ = ["Tokenizer", "ChatTemplateError", "render_chat_template"]

_SPECIAL_ATTRS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")


class ChatTemplateError(ValueError):
    """The chat template could not render these messages (the template's own
    ``raise_exception`` message, a Jinja error, or a checkpoint with no template)."""


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body (HF tracks assistant spans
    with it; rendering is the same)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # HF overrides Jinja's tojson, which would HTML-escape the output.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore attributes (as HF's)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} not allowed")


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = dict
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(template)


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    special_tokens: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> str:
    """Render ``template`` over ``messages`` exactly as transformers does.

    Messages are plain dicts; keys whose value is None are dropped (as transformers does).
    Raises :class:`ChatTemplateError` with the template's own message on failure.
    """
    chat = [{k: v for k, v in dict(m).items() if v is not None} for m in messages]
    if not chat:
        raise ChatTemplateError("messages must not be empty")
    context = {**(special_tokens or {}), **kwargs}
    context.setdefault("tools", None)
    context.setdefault("documents", None)
    try:
        return _compile(template).render(
            messages=chat, add_generation_prompt=add_generation_prompt, **context
        )
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from exc


class Tokenizer:
    """A checkpoint's tokenizer: ``tokenizers`` for text, Jinja for the chat template.

    Thread-safe for concurrent ``encode``/``decode`` (the Rust tokenizer is immutable here).
    """

    def __init__(
        self,
        tokenizer: _HFTokenizer,
        *,
        special_tokens: Mapping[str, str] | None = None,
        chat_template: str | None = None,
        extra_eos_token_ids: Sequence[int] = (),
        clean_up_tokenization_spaces: bool = False,
    ) -> None:
        self._tok = tokenizer
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self.chat_template = chat_template
        self._clean_up = clean_up_tokenization_spaces and not self._is_bpe()
        eos = [self.token_to_id(self.special_tokens.get("eos_token"))]
        self.eos_token_ids: tuple[int, ...] = tuple(
            dict.fromkeys(t for t in (*eos, *extra_eos_token_ids) if t is not None)
        )
        self.bos_token_id = self.token_to_id(self.special_tokens.get("bos_token"))
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load from a checkpoint directory (needs ``tokenizer.json``)."""
        root = Path(model_dir)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(
                f"{tok_file} not found: a checkpoint directory with a fast tokenizer is needed"
            )
        config = _read_json(root / "tokenizer_config.json")
        special = {a: t for a in _SPECIAL_ATTRS if (t := _token_text(config.get(a))) is not None}
        for name, value in _read_json(root / "special_tokens_map.json").items():
            text = _token_text(value) if name in _SPECIAL_ATTRS and name not in special else None
            if text is not None:
                special[name] = text
        template = _pick_template(config.get("chat_template"))
        jinja_file = root / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        gen_eos = _read_json(root / "generation_config.json").get("eos_token_id")
        extra = gen_eos if isinstance(gen_eos, list) else [gen_eos] if isinstance(gen_eos, int) else []
        return cls(
            _HFTokenizer.from_file(str(tok_file)),
            special_tokens=special,
            chat_template=template,
            extra_eos_token_ids=[int(t) for t in extra],
            clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
        )

    # --- text <-> ids ---------------------------------------------------------------------

    @property
    def backend(self) -> _HFTokenizer:
        """The underlying ``tokenizers.Tokenizer`` (for incremental decoding)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        text = self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self._clean_up else text

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    # --- chat -----------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """The prompt text for ``messages`` (extra ``kwargs`` are template variables)."""
        if self.chat_template is None:
            raise ChatTemplateError(
                "this checkpoint has no chat template (tokenizer_config.json 'chat_template' or "
                "chat_template.jinja); use the completions API with a plain prompt"
            )
        return render_chat_template(
            self.chat_template, messages, add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens, **kwargs,
        )

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Token ids of the rendered chat (no extra special tokens: the template has them)."""
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)

    def _is_bpe(self) -> bool:
        return type(self._tok.model).__name__ == "BPE"


def _pick_template(value: Any) -> str | None:
    """tokenizer_config's chat_template: a string, or a list of {name, template} (use 'default')."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        return named.get("default") or next(iter(named.values()), None)
    return None


def _clean_up(text: str) -> str:
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text
