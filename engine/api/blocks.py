"""KV block arithmetic shared by the engine and the router (torch-free).

A request of ``prompt_tokens`` that may generate ``max_tokens`` holds KV for every token but
the last one it samples: a sampled token's KV is written only when it is fed back to compute
the next one, and the last is never fed back. So it can fill
``ceil((prompt_tokens + max_tokens - 1) / block_size)`` blocks. The engine admits a request
only if that fits its cache (``engine.core.llm_engine``); the router books exactly that much on
the worker it sends the request to (``router.workers.load``, ``router.placement.decode``).
"""

from __future__ import annotations

__all__ = ["blocks_needed"]


def blocks_needed(prompt_tokens: int, max_tokens: int, block_size: int) -> int:
    """KV blocks a request can fill: its prompt plus every token it may generate but the last."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    return -(-max(0, prompt_tokens + max_tokens - 1) // block_size)
