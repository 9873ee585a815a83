"""Where converted models live: ``$KVCACHE_HOME/models`` (default ``~/.cache/kvcache-store``).

``resolve_model_dir(model)`` is what ``--model`` means to every command that loads one
(``kvengine serve``/``profile``, ``kvrouter serve``/``up``, the benchmarks): ``"default"`` is
the converted default model here, anything else a checkpoint directory; either must hold a
``config.json``.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["DEFAULT_MODEL_NAME", "cache_home", "models_dir", "default_model_dir", "resolve_model_dir"]

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


def resolve_model_dir(model: str) -> Path:
    """``"default"`` -> :func:`default_model_dir`; anything else -> that directory (absolute).

    Raises ``FileNotFoundError`` saying what to do when it holds no ``config.json``: the
    default model not converted yet, or a directory that is not a checkpoint.
    """
    path = default_model_dir() if model == "default" else Path(model).expanduser().resolve()
    if (path / "config.json").is_file():
        return path
    if model == "default":
        raise FileNotFoundError(
            f"the default model is not converted yet ({path} has no config.json); "
            "run `bash scripts/setup.sh` or `python -m engine.model.convert --default` first")
    raise FileNotFoundError(f"--model {model!r} is not a checkpoint directory (no config.json in {path})")
