"""Incremental detokenization of a token stream, with stop strings.

Workers stream token ids; the router turns them into text a piece at a time. Two things make
that harder than ``decode(new_ids)``:

- A character can span tokens (byte-level BPE splits multi-byte UTF-8; byte-fallback
  tokenizers emit ``<0xE2>`` tokens), and a token's text can depend on the one before it
  (SentencePiece's leading space). The stream decoder (``tokenizers.decoders.DecodeStream``,
  the one vLLM's fast incremental detokenizer uses) decodes a sliding window of ids and emits
  only text that is complete: never a replacement character for a half-received character.
  It is seeded with the prompt's last few ids so the first output token decodes in context.
- Stop strings may span tokens. Text that could still become a stop string (the longest suffix
  of the pending text that is a prefix of some stop string) is held back; once a stop string
  appears, the text is cut before it (or after it with ``include_stop_str_in_output``) and the
  stream is finished with reason ``"stop"``. Nothing after a stop string is ever emitted.

Contract: the concatenation of every ``push(...).text`` and ``flush()`` equals
``tokenizer.decode(all_output_ids)`` (with ``skip_special_tokens``) cut at the first stop
string: stable text only, emitted as early as possible.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers.decoders import DecodeStream

from engine.tokenizer import Tokenizer

__all__ = ["Delta", "IncrementalDetokenizer", "normalize_stop"]

_PROMPT_CONTEXT_TOKENS = 6  # ids of prompt context the stream decoder is seeded with


@dataclass(frozen=True, slots=True)
class Delta:
    """What one ``push`` produced.

    ``text``: new stable text to send. ``num_tokens``: how many of the pushed ids were
    consumed (fewer than pushed only when a stop string ended the stream: the ids after the
    one that completed it are dropped). ``stop_str``: the stop string that matched, if any.
    """

    text: str
    num_tokens: int
    stop_str: str | None = None

    @property
    def stopped(self) -> bool:
        return self.stop_str is not None


def normalize_stop(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """OpenAI's ``stop`` (None, a string or a list) as a tuple of non-empty strings."""
    if stop is None:
        return ()
    items = (stop,) if isinstance(stop, str) else tuple(stop)
    return tuple(dict.fromkeys(s for s in items if s))


class IncrementalDetokenizer:
    """Turns one request's output ids into text, a piece at a time. Not thread-safe; one per
    request (per choice when ``n > 1``)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        *,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tok = tokenizer.backend
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []        # every output id (for the fallback below)
        self._decoded_len = 0            # characters of output decoded so far
        self._fallback = False
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        for token_id in prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]:
            self._stream.step(self._tok, token_id)  # context only: its text is not output
        self._stops = normalize_stop(stop)
        self._include_stop = include_stop_str_in_output
        self._held = ""           # decoded text not yet emitted (a possible stop-string prefix)
        self._emitted: list[str] = []
        self.num_tokens = 0       # output ids consumed so far
        self.stop_str: str | None = None

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._emitted)

    @property
    def stopped(self) -> bool:
        return self.stop_str is not None

    def push(self, token_ids: Sequence[int]) -> Delta:
        """Feed new output ids; returns the text that became stable."""
        if self.stopped:
            return Delta("", 0, None)
        out: list[str] = []
        for i, token_id in enumerate(token_ids):
            piece = self._step(token_id)
            self.num_tokens += 1
            if not piece:
                continue
            self._held += piece
            if self._stops and self._check_stop(out):
                return Delta(self._record(out), i + 1, self.stop_str)
            safe = len(self._held) - self._stop_prefix_len()
            if safe:
                out.append(self._held[:safe])
                self._held = self._held[safe:]
        return Delta(self._record(out), len(token_ids))

    def _step(self, token_id: int) -> str | None:
        """The stream decoder's next piece. Should it ever fail (tokenizers reports an
        inconsistent prefix for some decoders), fall back to decoding all output ids and
        emitting the stable difference: slower, never wrong."""
        self._ids.append(token_id)
        if not self._fallback:
            try:
                piece = self._stream.step(self._tok, token_id)
                self._decoded_len += len(piece) if piece else 0
                return piece
            except Exception:  # noqa: BLE001 - any decoder failure takes the slow path
                self._fallback = True
        text = self._tok.decode(self._ids, skip_special_tokens=self._skip_special)
        if text.endswith("\ufffd") or len(text) <= self._decoded_len:
            return None
        piece, self._decoded_len = text[self._decoded_len:], len(text)
        return piece

    def flush(self) -> str:
        """The stream ended without a stop string: release the text held back."""
        text, self._held = ("" if self.stopped else self._held), ""
        return self._record([text])

    def _record(self, parts: list[str]) -> str:
        text = "".join(parts)
        if text:
            self._emitted.append(text)
        return text

    def _check_stop(self, out: list[str]) -> bool:
        """Cut ``_held`` at the earliest stop string, if any; appends the kept text to ``out``."""
        best: tuple[int, str] | None = None
        for s in self._stops:
            pos = self._held.find(s)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, s)
        if best is None:
            return False
        pos, s = best
        out.append(self._held[: pos + len(s)] if self._include_stop else self._held[:pos])
        self._held = ""
        self.stop_str = s
        return True

    def _stop_prefix_len(self) -> int:
        """Length of the longest suffix of ``_held`` that is a proper prefix of a stop string."""
        held, best = self._held, 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(held)), best, -1):
                if held.endswith(s[:k]):
                    best = k
                    break
        return best
