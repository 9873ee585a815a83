"""Seeded serving workloads made of token-id prompts (no tokenizer involved).

A workload is a list of ``BenchRequest``s: an open-loop request is sent at ``arrival_s``
seconds after the start; a follow-up (``after`` set: a chat turn) is sent ``delay_s`` after the
request it follows has finished. Prompts are token ids in ``[token_low, vocab_size)``, so the
special ids at the bottom of a vocabulary are never sent. Prompt contents come from the
``seed`` alone and arrival times from a separate stream, so two rates of one workload send
the same prompts, and a mixed workload with its huge prefills dropped keeps the very same
short requests at the very same times.

1. ``mixed``: short decode-heavy requests and, with probability ``long_share``, a huge prefill.
2. ``multi_turn``: chat sessions; turn ``k``'s prompt is turn ``k-1``'s prompt, a reply of
   ``max_tokens`` synthetic tokens standing for the model's answer (the client cannot know the
   answer's token ids; with ``ignore_eos`` its length is exact), and a new user message.
   Sessions start as a Poisson process at ``rate / turns``, so the request rate is about
   ``rate``; a session ends early rather than truncate its shared history.
3. ``trace``: a window of the Mooncake trace (``hash_ids`` of 512-token blocks) at
   ``1/scale``: a 512-token block becomes ``512/scale`` tokens synthesized from
   ``(seed, hash_id)`` only, so equal ids give equal tokens and shared leading ids give
   identical token prefixes. What of the history before the window can give the window hits
   is returned as ``prewarm`` (``TraceSpec.prewarm``).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

__all__ = [
    "BenchRequest", "Workload", "TokenSpace", "poisson_arrivals", "block_tokens",
    "MixedSpec", "ChatSpec", "TraceSpec", "shared_prefixes", "load_trace", "DEFAULT_TRACE",
]

# Shipped in the repository (Apache-2.0, from kvcache-ai/Mooncake): planner/data/README.md
DEFAULT_TRACE = Path(__file__).resolve().parent / "data" / "mooncake_synthetic_trace.jsonl"
TRACE_BLOCK_TOKENS = 512  # the Mooncake trace's block size


def _opt(default: Any, help: str) -> Any:
    """A spec field: its default and its ``--flag`` help (see ``serve_bench.add_spec_args``)."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class BenchRequest:
    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    arrival_s: float = 0.0  # open-loop send time after the start (unused when ``after`` is set)
    after: str | None = None  # id of the request whose completion releases this one
    delay_s: float = 0.0  # think time after ``after`` finished
    tag: str = ""


@dataclass
class Workload:
    name: str
    requests: list[BenchRequest]
    prewarm: list[BenchRequest] = field(default_factory=list)  # sent before timing, not measured
    scaling: dict[str, Any] = field(default_factory=dict)  # parameters and scaling, for results

    def probe_shape(self, min_output: int = 16) -> tuple[int, int]:
        """(prompt tokens, max tokens) of a typical request: the medians over the requests of
        the most common tag (the short ones of ``mixed``), output at least ``min_output`` so
        that TPOT is measurable. Used to measure unloaded latency."""
        tag = Counter(r.tag for r in self.requests).most_common(1)[0][0]
        typical = [r for r in self.requests if r.tag == tag]
        p = int(np.median([len(r.prompt) for r in typical]))
        o = int(np.median([r.max_tokens for r in typical]))
        return p, max(o, min_output)

    def long_probe_prompt(self) -> int:
        """The 90th-percentile prompt length over all requests: the second probe of
        per-length TTFT objectives."""
        return int(np.percentile([len(r.prompt) for r in self.requests], 90))

    def truncate(self, n: int) -> "Workload":
        """The first ``n`` open-loop requests, with the follow-ups of those kept."""
        keep: set[str] = set()
        roots = 0
        out = []
        for r in self.requests:
            if r.after is None:
                roots += 1
                if roots > n:
                    continue
            elif r.after not in keep:
                continue
            keep.add(r.request_id)
            out.append(r)
        return replace(self, requests=out)


@dataclass(frozen=True)
class TokenSpace:
    """The ids prompts are drawn from, and the context they must fit."""

    vocab_size: int = _opt(49152, "prompt token ids are below this (the model's vocabulary)")
    token_low: int = _opt(100, "prompt token ids are at least this (keeps special tokens out)")
    max_context: int = _opt(2048, "the model's context: prompt + max_tokens never exceed it")

    def __post_init__(self) -> None:
        if not 0 <= self.token_low < self.vocab_size:
            raise ValueError(f"need 0 <= token_low < vocab_size, got {self}")

    def random(self, rng: np.random.Generator, n: int) -> tuple[int, ...]:
        return tuple(rng.integers(self.token_low, self.vocab_size, size=n).tolist())


def poisson_arrivals(n: int, rate: float, rng: np.random.Generator) -> list[float]:
    """``n`` arrival times (s) of a Poisson process at ``rate``/s, the first at 0.
    ``rate = inf`` sends everything at once."""
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    if math.isinf(rate) or n == 0:
        return [0.0] * n
    gaps = rng.exponential(1.0 / rate, size=n - 1)
    return [0.0] + np.cumsum(gaps).tolist()


def block_tokens(seed: int, hash_id: int, n: int, space: TokenSpace) -> tuple[int, ...]:
    """The ``n`` tokens of trace block ``hash_id``: a function of ``(seed, hash_id)`` only.
    (Random streams are keyed ``[seed, 1]`` contents, ``[seed, 2]`` timing, ``[seed, 3, id]``
    trace blocks, ``[seed, 4]`` unloaded probes, so no two purposes share a stream.)"""
    rng = np.random.default_rng([seed, 3, hash_id])
    return space.random(rng, n)


def _jittered(rng: np.random.Generator, mean: int, jitter: float, lo: int = 1) -> int:
    return max(lo, int(round(mean * rng.uniform(1 - jitter, 1 + jitter)))) if jitter else max(lo, mean)


@dataclass(frozen=True)
class MixedSpec:
    """Short decode-heavy requests plus rare huge prefills (tags ``short`` / ``long``)."""

    short_prompt: int = _opt(128, "mean prompt tokens of a short request")
    short_output: int = _opt(128, "output tokens of a short request")
    long_prompt: int = _opt(1536, "mean prompt tokens of a huge prefill")
    long_output: int = _opt(16, "output tokens of a huge prefill")
    long_share: float = _opt(0.05, "probability that a request is a huge prefill")
    jitter: float = _opt(0.25, "prompt lengths are uniform in mean*(1 +- jitter)")
    include_long: bool = _opt(True, "send the huge prefills (off: the same short requests alone)")

    def build(self, num_requests: int, rate: float, seed: int, space: TokenSpace) -> Workload:
        if not 0 <= self.long_share <= 1:
            raise ValueError(f"long_share must be in [0, 1], got {self.long_share}")
        for p, o in ((self.short_prompt, self.short_output), (self.long_prompt, self.long_output)):
            if p * (1 + self.jitter) + o > space.max_context:
                raise ValueError(f"prompt {p} (+{self.jitter:.0%}) + output {o} exceeds max_context "
                                 f"{space.max_context}")
        content = np.random.default_rng([seed, 1])
        arrivals = poisson_arrivals(num_requests, rate, np.random.default_rng([seed, 2]))
        requests = []
        for i, t in enumerate(arrivals):
            is_long = content.uniform() < self.long_share
            p, o = (self.long_prompt, self.long_output) if is_long else (self.short_prompt, self.short_output)
            prompt = space.random(content, _jittered(content, p, self.jitter))  # drawn either way
            if is_long and not self.include_long:
                continue
            requests.append(BenchRequest(f"mixed-{seed}-{i}", prompt, o, t, tag="long" if is_long else "short"))
        return Workload("mixed", requests, scaling=asdict(self))


@dataclass(frozen=True)
class ChatSpec:
    """Multi-turn chat sessions sharing their history (tags ``turn0`` .. ``turnT-1``)."""

    users: int = _opt(32, "chat sessions (each is one user)")
    turns: int = _opt(4, "turns per session (a session ends early at the context limit)")
    system_prompt: int = _opt(0, "tokens of a system prompt shared by every session")
    first_message: int = _opt(256, "mean tokens of a session's first message")
    message: int = _opt(64, "mean tokens of each later user message")
    reply: int = _opt(64, "output tokens of every turn")
    think_time_s: float = _opt(1.0, "mean (exponential) pause between an answer and the next turn")
    jitter: float = _opt(0.25, "message lengths are uniform in mean*(1 +- jitter)")

    def build(self, rate: float, seed: int, space: TokenSpace) -> Workload:
        """Sessions start as a Poisson process at ``rate / turns``: about ``rate`` requests/s."""
        content = np.random.default_rng([seed, 1])
        timing = np.random.default_rng([seed, 2])
        system = space.random(content, self.system_prompt)
        starts = poisson_arrivals(self.users, rate / self.turns, timing)
        requests = []
        for u, start in enumerate(starts):
            history = system + space.random(content, _jittered(content, self.first_message, self.jitter))
            prev: str | None = None
            for k in range(self.turns):
                if k > 0:
                    history += space.random(content, self.reply)  # stands for the previous answer
                    history += space.random(content, _jittered(content, self.message, self.jitter))
                think = float(timing.exponential(self.think_time_s)) if self.think_time_s > 0 else 0.0
                if len(history) + self.reply > space.max_context:
                    break
                rid = f"chat-{seed}-u{u}-t{k}"
                requests.append(BenchRequest(rid, history, self.reply, start if prev is None else 0.0,
                                             after=prev, delay_s=think if prev else 0.0, tag=f"turn{k}"))
                prev = rid
        return Workload("multi_turn", requests, scaling=dict(asdict(self), session_rate=rate / self.turns))


@dataclass(frozen=True)
class TraceSpec:
    """A window of a Mooncake-format trace at ``1/scale`` (tag ``trace``).

    Lengths become ``ceil(len/scale)``, so a request keeps exactly one scaled block per hash
    id; outputs are divided by ``output_scale`` (0: ``scale``) and kept at least
    ``min_output``; a prompt is cut to ``max_context - max_tokens`` (a cut keeps its prefix).
    Arrivals are the trace's offsets from the window's first request times ``time_scale``, or
    rescaled to a mean of ``rate``/s when a rate is given.

    ``prewarm`` (sent before timing, each with one output token): ``all`` the requests before
    the window, ``none``, or ``shared``: only what can give a window request a hit, the
    prefixes ``shared_prefixes`` finds: for each window request the longest run of leading
    hash ids (whole blocks in both prompts) it shares with some history request, each
    distinct prefix once and none that is a prefix of another sent (sending the longer one
    caches it), in history order (``shared_prefixes`` says why that order suits LRU caches).
    On a trace whose requests all start with one system-prompt block, that is a handful of
    prefixes where matching first blocks alone sent the whole history.
    """

    path: str = _opt(str(DEFAULT_TRACE), "Mooncake-format trace (JSON lines)")
    start: int = _opt(1000, "index of the window's first request (earlier ones are history)")
    count: int = _opt(300, "requests in the window")
    scale: int = _opt(32, "length scale: 512-token blocks become 512/scale tokens")
    output_scale: int = _opt(0, "output length scale (0: the same as --trace-scale)")
    min_output: int = _opt(1, "least output tokens of a request")
    time_scale: float = _opt(1.0, "multiply the trace's inter-arrival times (ignored with a rate)")
    prewarm: str = _opt("shared", "history sent before timing: all, none, or shared: each distinct longest "
                                   "prefix a window request shares with the history, once")

    def build(self, rate: float | None, seed: int, space: TokenSpace) -> Workload:
        if TRACE_BLOCK_TOKENS % self.scale:
            raise ValueError(f"scale must divide {TRACE_BLOCK_TOKENS}, got {self.scale}")
        if self.prewarm not in ("all", "shared", "none"):
            raise ValueError(f"prewarm must be all, shared or none, got {self.prewarm!r}")
        rows = load_trace(self.path)
        if not 0 <= self.start < len(rows):
            raise ValueError(f"start {self.start} outside the trace's {len(rows)} requests")
        window, history = rows[self.start:self.start + self.count], rows[:self.start]
        block = TRACE_BLOCK_TOKENS // self.scale
        oscale = self.output_scale or self.scale
        cache: dict[int, tuple[int, ...]] = {}

        def tokens_of(ids: Sequence[int]) -> list[int]:
            toks: list[int] = []
            for h in ids:
                if h not in cache:
                    cache[h] = block_tokens(seed, h, block, space)
                toks.extend(cache[h])
            return toks

        def prompt_of(row: dict[str, Any], max_tokens: int) -> tuple[int, tuple[int, ...]]:
            n = math.ceil(row["input_length"] / self.scale)
            cut = min(n, space.max_context - max_tokens)
            return n, tuple(tokens_of(row["hash_ids"][: math.ceil(cut / block)])[:cut])

        t0 = window[0]["timestamp"]
        span_s = (window[-1]["timestamp"] - t0) / 1000.0
        native_rate = (len(window) - 1) / span_s if span_s > 0 else math.inf
        time_scale = self.time_scale
        if rate is not None:
            time_scale = native_rate / rate if math.isfinite(native_rate) else 0.0
        requests, cut_count = [], 0
        for i, row in enumerate(window):
            out = max(self.min_output, math.ceil(row["output_length"] / oscale))
            n, prompt = prompt_of(row, out)
            cut_count += len(prompt) < n
            arrival = (row["timestamp"] - t0) / 1000.0 * time_scale
            requests.append(BenchRequest(f"trace-{seed}-{self.start + i}", prompt, out, arrival, tag="trace"))
        warm: list[BenchRequest] = []
        if self.prewarm == "all":
            warm = [BenchRequest(f"trace-{seed}-{j}-prewarm", prompt_of(r, 1)[1], 1, tag="prewarm")
                    for j, r in enumerate(history)]
        elif self.prewarm == "shared":
            # whole blocks only: a partial last block (or one past the context cut) never hits
            def whole(row: dict[str, Any], n_tokens: int) -> list[int]:
                return row["hash_ids"][: n_tokens // block]
            past = [whole(r, min(math.ceil(r["input_length"] / self.scale), space.max_context - 1)) for r in history]
            now = [whole(r, len(q.prompt)) for r, q in zip(window, requests)]
            for j, ids in shared_prefixes(past, now):
                warm.append(BenchRequest(f"trace-{seed}-{j}-prewarm", tuple(tokens_of(ids)), 1, tag="prewarm"))
        scaling = dict(asdict(self), path=Path(self.path).name, count=len(window), block_tokens=block,
                       output_scale=oscale, time_scale=time_scale, native_rate=native_rate,
                       mean_rate=native_rate / time_scale if time_scale else math.inf,
                       prompts_cut_to_context=cut_count, prewarm_requests=len(warm),
                       prewarm_tokens=sum(len(r.prompt) for r in warm))
        return Workload("trace", requests, prewarm=warm, scaling=scaling)


def shared_prefixes(history: Sequence[Sequence[int]],
                    window: Sequence[Sequence[int]]) -> list[tuple[int, tuple[int, ...]]]:
    """What to pre-warm so that every window request finds its reusable prefix cached.

    ``history`` and ``window`` are the requests' block ids (whole blocks only). For each window
    request, the longest run of leading ids it shares with any history request; each distinct
    run once, and none that is a prefix of another kept (the longer one caches it). Returned as
    ``(j, ids)``, ``j`` the last history request that holds ``ids``, in history order.

    Why history order and not longest-first: caches evict the least recently used blocks, so
    the order of sending decides what survives when the pre-warm outgrows a cache. Sent in
    history order, a prefix is as recent, relative to the others, as the trace's own history
    made it, so the cache at the window's start keeps what a run of the whole history would
    keep (the blocks that can hit, without the rest's pressure), and the prefixes the history
    used last, those that nearby window requests are likeliest to reuse, are evicted last.
    Longest-first would leave the longest prefixes, the most tokens to save, oldest, first to
    go, and order them by length, which says nothing about when they are reused. (A block that
    several prefixes share, a system prompt, is refreshed by each, so it stays warm either way.)
    """
    trie: dict[int, Any] = {}  # id -> [last history index holding this prefix, children]
    for j, ids in enumerate(history):
        node = trie
        for h in ids:
            entry = node.setdefault(h, [j, {}])
            entry[0] = j
            node = entry[1]
    last: dict[tuple[int, ...], int] = {}
    for ids in window:
        node, k, j = trie, 0, -1
        while k < len(ids) and ids[k] in node:
            j, node = node[ids[k]]
            k += 1
        if k:
            last[tuple(ids[:k])] = j
    runs = sorted(last)  # lexicographic: a run that prefixes another is right before one that has it
    kept = [p for p, q in zip(runs, runs[1:] + [()]) if q[:len(p)] != p]
    return sorted((last[p], p) for p in kept)


def load_trace(path: str | Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
