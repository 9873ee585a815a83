"""Incremental detokenization of a token stream, with stop strings.

Workers stream token ids; the router turns them into text a piece at a time. Two things make
that harder than ``decode(new_ids)``:

- A character can span tokens (byte-level BPE splits multi-byte UTF-8; byte-fallback
  tokenizers emit ``<0xE2>`` tokens), and a token's text can depend on the one before it
  (SentencePiece's leading space). So, as vLLM's incremental detokenizer does, the ids are
  decoded in a sliding window ``ids[prefix_offset:]``: the text beyond ``ids[prefix_offset:
  read_offset]`` is emitted once it no longer ends with U+FFFD (a character still waiting
  for its remaining bytes), and the window then moves past it. At the end (``flush``) the
  rest is emitted as ``decode`` gives it, replacement characters and all.
- The window is seeded with the prompt's last few ids, so the first output token decodes in
  context, but only up to a point where the prompt's text is complete: a prompt that ends in
  half a character must not lend its bytes to the first output token (decoding the output
  alone renders those bytes as U+FFFD, and so must the stream).
- Stop strings may span tokens. Text that could still become a stop string (the longest suffix
  of the pending text that is a prefix of some stop string) is held back; once a stop string
  appears, the text is cut before it (or after it with ``include_stop_str_in_output``) and the
  stream is finished with reason ``"stop"``. Nothing after a stop string is ever emitted.

Contract: the concatenation of every ``push(...).text`` and ``flush()`` equals
``tokenizer.backend.decode(output_ids, skip_special_tokens=...)`` cut at the first stop string,
for any ids (tests/router/test_detokenizer.py checks it over random sequences). That is
``Tokenizer.decode`` for every byte-level BPE tokenizer (Llama 3, Qwen2/3, SmolLM2, the tiny
test model); the one exception is a tokenizer whose decoder drops the first token's leading
space (SentencePiece's Metaspace): there the prompt context keeps the space, as vLLM and
OpenAI return a continuation. ``clean_up_tokenization_spaces`` is not applied to streamed text
(it is off for every BPE tokenizer, see ``engine.api.tokenizer``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.api.tokenizer import Tokenizer

__all__ = ["TextDelta", "IncrementalDetokenizer", "normalize_stop"]

_PROMPT_CONTEXT_TOKENS = 6  # prompt ids the decoding window starts with (at most)
_INCOMPLETE = "\ufffd"      # what decode gives for bytes of a character not yet complete


@dataclass(frozen=True, slots=True)
class TextDelta:
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
        # The decoding window: ids[prefix_offset:read_offset] is text already emitted (or
        # prompt context), kept so the next token decodes in context; what lies beyond it is
        # pending until it decodes to complete characters.
        self._ids = self._context(prompt_token_ids)
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
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

    def push(self, token_ids: Sequence[int]) -> TextDelta:
        """Feed new output ids; returns the text that became stable."""
        if self.stopped:
            return TextDelta("", 0, None)
        out: list[str] = []
        for i, token_id in enumerate(token_ids):
            self._ids.append(token_id)
            self.num_tokens += 1
            piece = self._step()
            if not piece:
                continue
            self._held += piece
            if self._check_stop(out):
                return TextDelta(self._record(out), i + 1, self.stop_str)
            self._emit_safe(out)
        return TextDelta(self._record(out), len(token_ids))

    def flush(self) -> str:
        """The stream ended: release the text held back, and the window's rest as ``decode``
        gives it (a character cut off by the end stays U+FFFD). A stop string can still
        match in that rest; ``stopped`` then says so and the text is cut there."""
        if self.stopped:
            return ""
        out: list[str] = []
        text = self._decode(self._ids[self._prefix_offset:])
        self._held += text[len(self._prefix_text):]
        if not self._check_stop(out):
            out.append(self._held)
            self._held = ""
        return self._record(out)

    # --- internals ------------------------------------------------------------------------

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=self._skip_special)

    def _context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The prompt's last few ids, shortened until their text is complete (a prompt ending
        in half a character gives no context past the last whole one)."""
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        while context and self._decode(context).endswith(_INCOMPLETE):
            context.pop()
        return context

    def _step(self) -> str:
        """The window's new complete text after the id just appended ("" while pending)."""
        text = self._decode(self._ids[self._prefix_offset:])
        if len(text) <= len(self._prefix_text) or text.endswith(_INCOMPLETE):
            return ""
        piece = text[len(self._prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        return piece

    def _emit_safe(self, out: list[str]) -> None:
        """Move the held text that cannot start a stop string to ``out``."""
        safe = len(self._held) - self._stop_prefix_len()
        if safe:
            out.append(self._held[:safe])
            self._held = self._held[safe:]

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
