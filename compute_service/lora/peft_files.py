"""PEFT's LoRA format: a directory with `adapter_config.json` and `adapter_model.safetensors`, read into one
(A, B) pair per decoder layer and target module, B scaled by lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)).

Read and checked before anything is resident; every refusal is an AdapterError whose message names the
adapter, what does not fit and what is served."""

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
# base_model.model.model.layers.<i>.<path>.lora_A.weight
_KEY = re.compile(r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(.+)\.lora_([AB])\.weight$")
# adapter_config.json settings that change the function and that compute does not run, with their no-op value
_UNSUPPORTED = {
    "use_dora": False,
    "bias": "none",
    "fan_in_fan_out": False,
    "rank_pattern": {},
    "alpha_pattern": {},
    "modules_to_save": None,
    "layer_replication": None,
}


class AdapterError(ValueError):
    """An adapter that cannot be served on this model; the message says why and what is."""


@dataclass(frozen=True)
class AdapterWeights:
    """One adapter's low-rank pairs: (layer, target module) -> (A [r, in], B [out, r] already scaled)."""

    rank: int
    alpha: float
    rslora: bool
    pairs: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def targets(self) -> list[str]:
        return sorted({target for _, target in self.pairs})


@dataclass(frozen=True)
class AdapterShapes:
    """An adapter as its files declare it, no tensor read: its config, and (layer, target module) -> the
    tensor names and shapes of its lora_A [r, in] and lora_B [out, r]."""

    config: dict
    halves: dict[tuple[int, str], dict[str, tuple[str, tuple[int, ...]]]]

    @property
    def rank(self) -> int:
        return max(pair["A"][1][0] for pair in self.halves.values())


def inspect(name: str, directory: str | Path) -> AdapterShapes:
    """The adapter in `directory` from its config and its safetensors header alone; AdapterError when it is
    not a LoRA adapter compute runs (the files, the config's settings, the tensors' names and pairing)."""
    path = Path(directory)
    if not (path / CONFIG).is_file() or not (path / WEIGHTS).is_file():
        raise AdapterError(f"adapter {name!r}: {path} must hold {CONFIG} and {WEIGHTS} (PEFT's LoRA format)")
    config = json.loads((path / CONFIG).read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter {name!r}: peft_type {config.get('peft_type')!r}; only LORA is served")
    for key, default in _UNSUPPORTED.items():
        if config.get(key, default) not in (default, None, {}, []):
            raise AdapterError(f"adapter {name!r}: {key}={config[key]!r} is not served (plain LoRA only)")
    halves: dict[tuple[int, str], dict[str, tuple[str, tuple[int, ...]]]] = {}
    for key, shape in _header(name, path / WEIGHTS).items():
        match = _KEY.match(key)
        if match is None:
            raise AdapterError(
                f"adapter {name!r}: tensor {key!r} is not a LoRA A/B weight of a decoder layer's linear"
            )
        layer, module, half = int(match[1]), match[2].rsplit(".", 1)[-1], match[3]
        halves.setdefault((layer, module), {})[half] = (key, shape)
    if not halves:
        raise AdapterError(f"adapter {name!r}: {WEIGHTS} holds no LoRA weights")
    for (layer, module), pair in halves.items():
        if set(pair) != {"A", "B"} or len(pair["A"][1]) != 2 or pair["A"][1][0] != pair["B"][1][-1]:
            raise AdapterError(f"adapter {name!r}: layer {layer} {module} lacks a matching lora_A/lora_B")
    return AdapterShapes(config, halves)


def _header(name: str, path: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape by name, from the safetensors header; AdapterError for a file that is not one."""
    try:
        with safe_open(str(path), "pt") as weights:
            return {key: tuple(weights.get_slice(key).get_shape()) for key in weights.keys()}  # noqa: SIM118 (not a dict)
    except SafetensorError as err:
        raise AdapterError(f"adapter {name!r}: {path} is not a safetensors file ({err})") from err


def read(name: str, directory: str | Path, dtype: torch.dtype) -> AdapterWeights:
    """The adapter in `directory` (PEFT's LoRA format) as `dtype` tensors; AdapterError when it is not one
    compute runs."""
    shapes = inspect(name, directory)
    tensors = load_file(str(Path(directory) / WEIGHTS))
    alpha = float(shapes.config.get("lora_alpha", 8))
    rslora = bool(shapes.config.get("use_rslora", False))
    pairs = {}
    for site, pair in shapes.halves.items():
        a, b = tensors[pair["A"][0]], tensors[pair["B"][0]]
        r = a.shape[0]
        scaling = alpha / (math.sqrt(r) if rslora else r)
        pairs[site] = (a.to(dtype).contiguous(), (b.to(torch.float32) * scaling).to(dtype))
    return AdapterWeights(shapes.rank, alpha, rslora, pairs)
