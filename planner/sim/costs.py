"""Step times from a profile: what one engine step of a scheduled batch costs.

A step is one forward pass over a batch: ``decodes`` (one token each, each over its own
context) and prefill chunks (``k`` tokens from position ``p``). Its time, from one
``kvengine profile`` (``engine.profile.format``) and nothing else:

- a pure decode step: the measured decode grid interpolated (bilinear in batch and mean
  context, between the measured points; the fit beyond them). The fit alone misses the
  measured points by up to a third on a CPU (a batch of 2 costs 1.7x a batch of 1, a batch of
  8 hardly more than 4), and the simulator is only as good as its step times;
- a prefill-only step: the prefill fit, ``a + sum over chunks of (b*k + c*pairs(k, p))``
  (one pass: one overhead ``a``);
- a mixed step: the decode step of its decodes plus each chunk's marginal prefill time
  ``b*k + c*pairs`` (the decodes ride in the pass the prefill pays for, or the reverse).

With the profile's ``serving`` section (``benchmarks.planner.stack_profile``: what the router, HTTP,
the streaming client, the store and etcd add on the same machine), a step that decodes ``n``
sequences costs ``serving.step_s + serving.token_s * n`` more, a step's prefill work (its
chunks, and a prefill-only step's overhead) costs ``serving.prefill_factor`` times the curves'
(the stack's CPU slows prefills as well), and ``hop_s`` is the latency of one message between
client, router and worker (0 without it).

Store moves (blocks of the simulated block size, which may differ from the profile's: their
bytes are what counts): ``load_s(blocks)`` (synchronous on the engine thread, at admission) and
``save_s(blocks)`` (the saver thread's time for one batch of blocks) from the fitted
``store_load`` / ``store_save`` curves.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from engine.profile.format import Profile

__all__ = ["StepCosts"]


class StepCosts:
    """Step and transfer times of one profile (see the module docstring)."""

    def __init__(self, profile: Profile, block_size: int | None = None) -> None:
        """``block_size``: the simulated workers' (default the profile's); a block's bytes
        scale with it, so store moves cost what that many tokens' KV costs."""
        self.profile = profile
        pre = profile.curves["prefill"].fit
        coef = dict(zip(pre.terms, pre.coefficients))
        self._p_step, self._p_tok, self._p_att = coef["steps"], coef["tokens"], coef["attention"]
        dec = profile.curves["decode"].fit
        coef = dict(zip(dec.terms, dec.coefficients))
        self._d_step, self._d_seq, self._d_ctx = coef["step"], coef["batch"], coef["batch_context"]
        grid: dict[tuple[int, int], float] = {}
        for p in profile.curves["decode"].points:
            grid[(p.batch, p.context)] = p.seconds
        self._batches = sorted({b for b, _ in grid})
        self._contexts = sorted({c for _, c in grid})
        full = all((b, c) in grid for b in self._batches for c in self._contexts)
        self._grid = grid if full and len(self._batches) > 1 and len(self._contexts) > 1 else None
        lo, sv = profile.curves["store_load"].fit, profile.curves["store_save"].fit
        self._load = dict(zip(lo.terms, lo.coefficients))
        self._save = dict(zip(sv.terms, sv.coefficients))
        self._memo: dict[tuple[int, int], float] = {}
        stack = profile.serving
        self.hop_s = stack.hop_s if stack else 0.0
        self._o_step, self._o_tok = (stack.step_s, stack.token_s) if stack else (0.0, 0.0)
        self.prefill_factor = stack.prefill_factor if stack else 1.0
        self.block_size = block_size or profile.model.block_size
        self.block_bytes = profile.model.kv_bytes_per_token * self.block_size

    # --- decode ------------------------------------------------------------------------
    def _decode_fit(self, batch: float, context: float) -> float:
        return self._d_step + self._d_seq * batch + self._d_ctx * batch * (context + 1)

    def decode_s(self, batch: int, mean_context: float) -> float:
        """One step of ``batch`` decodes over ``mean_context`` tokens each, on average
        (remembered per batch and whole mean context: a simulation asks the same often)."""
        if batch <= 0:
            return 0.0
        key = (batch, int(mean_context))
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        if len(self._memo) > 200_000:
            self._memo.clear()
        out = self._memo[key] = self._decode(batch, float(key[1]))
        return out

    def _decode(self, batch: int, mean_context: float) -> float:
        if self._grid is None:
            return self._decode_fit(batch, mean_context)
        bs, cs = self._batches, self._contexts
        b = min(max(float(batch), bs[0]), bs[-1])
        c = min(max(mean_context, cs[0]), cs[-1])
        inside = self._interp(b, c)
        if b == batch and c == mean_context:
            return inside
        # Outside the grid: the nearest edge point, moved by what the fit says the rest costs.
        return max(inside + self._decode_fit(batch, mean_context) - self._decode_fit(b, c), 1e-6)

    def _interp(self, batch: float, context: float) -> float:
        assert self._grid is not None
        g, bs, cs = self._grid, self._batches, self._contexts
        i = min(max(bisect.bisect_right(bs, batch) - 1, 0), len(bs) - 2)
        j = min(max(bisect.bisect_right(cs, context) - 1, 0), len(cs) - 2)
        b0, b1, c0, c1 = bs[i], bs[i + 1], cs[j], cs[j + 1]
        u = (batch - b0) / (b1 - b0)
        v = (context - c0) / (c1 - c0)
        return ((1 - u) * (1 - v) * g[(b0, c0)] + u * (1 - v) * g[(b1, c0)]
                + (1 - u) * v * g[(b0, c1)] + u * v * g[(b1, c1)])

    def stack_s(self, decodes: int) -> float:
        """What the serving stack adds to a step that streams ``decodes`` tokens."""
        return self._o_step + self._o_tok * decodes if decodes > 0 else 0.0

    # --- prefill -----------------------------------------------------------------------
    def chunk_s(self, tokens: int, start: int) -> float:
        """A prefill chunk's marginal time: ``tokens`` from position ``start`` (no overhead)."""
        return self._p_tok * tokens + self._p_att * tokens * (start + (tokens + 1) / 2)

    def prefill_s(self, tokens: int, cached: int = 0, chunk: int = 0) -> float:
        """A whole prefill alone: ``tokens`` after ``cached``, in chunks of ``chunk`` (0: one)."""
        size = chunk if chunk > 0 else max(tokens, 1)
        t, done = 0.0, 0
        while done < tokens:
            k = min(size, tokens - done)
            t += self._p_step + self.chunk_s(k, cached + done)
            done += k
        return t

    def step_s(self, decode_contexts: Sequence[int], chunks: Sequence[tuple[int, int]]) -> float:
        """One step: decodes over these contexts, prefill chunks ``(tokens, start)``."""
        extra = 0.0
        for k, p in chunks:
            extra += self.chunk_s(k, p)
        if decode_contexts:
            n = len(decode_contexts)
            return self.decode_s(n, sum(decode_contexts) / n) + extra * self.prefill_factor + self.stack_s(n)
        return (self._p_step + extra) * self.prefill_factor if chunks else 0.0

    # --- the store ---------------------------------------------------------------------
    def load_s(self, blocks: int) -> float:
        if blocks <= 0:
            return 0.0
        return self._load["call"] + self._load["bytes"] * blocks * self.block_bytes

    def save_s(self, blocks: int) -> float:
        if blocks <= 0:
            return 0.0
        return self._save["call"] + self._save["bytes"] * blocks * self.block_bytes
