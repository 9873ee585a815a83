"""The serving engine: model over a paged KV cache, scheduler, kvstore connector, worker.

Importing ``engine`` is cheap and torch-free; torch-using modules are imported on use::

    from engine.model.runner import ModelRunner, StepItem
    runner = ModelRunner(model_dir, num_blocks=256)
    logits = runner.execute([StepItem(token_ids=prompt, start_pos=0, block_table=[0, 1])])
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "__version__":  # lazily: most imports never ask (kvstore/version.py)
        from kvstore.version import installed_version  # one source for the distribution

        return installed_version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
