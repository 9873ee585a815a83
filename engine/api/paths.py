"""Where converted models live: ``$KVCACHE_HOME/models`` (default ``~/.cache/kvcache-store``)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["DEFAULT_MODEL_NAME", "cache_home", "models_dir", "default_model_dir"]

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def cache_home() -> Path:
    """``$KVCACHE_HOME`` if set, else ``~/.cache/kvcache-store``."""
    env = os.environ.get("KVCACHE_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvcache-store"


def models_dir() -> Path:
    return cache_home() / "models"


def default_model_dir() -> Path:
    """The converted default model's checkpoint directory (it may not exist yet)."""
    return models_dir() / DEFAULT_MODEL_NAME
