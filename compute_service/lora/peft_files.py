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


def read(name: str, directory: str | Path, dtype: torch.dtype) -> AdapterWeights:
    """The adapter in `directory` (PEFT's LoRA format) as `dtype` tensors; AdapterError when it is not one
    compute runs."""
    path = Path(directory)
    if not (path / CONFIG).is_file() or not (path / WEIGHTS).is_file():
        raise AdapterError(f"adapter {name!r}: {path} must hold {CONFIG} and {WEIGHTS} (PEFT's LoRA format)")
    config = json.loads((path / CONFIG).read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"adapter {name!r}: peft_type {config.get('peft_type')!r}; only LORA is served")
    for key, default in _UNSUPPORTED.items():
        if config.get(key, default) not in (default, None, {}, []):
            raise AdapterError(f"adapter {name!r}: {key}={config[key]!r} is not served (plain LoRA only)")
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(path / WEIGHTS)).items():
        match = _KEY.match(key)
        if match is None:
            raise AdapterError(
                f"adapter {name!r}: tensor {key!r} is not a LoRA A/B weight of a decoder layer's linear"
            )
        layer, module, half = int(match[1]), match[2].rsplit(".", 1)[-1], match[3]
        halves.setdefault((layer, module), {})[half] = tensor
    if not halves:
        raise AdapterError(f"adapter {name!r}: {WEIGHTS} holds no LoRA weights")
    alpha, rslora = float(config.get("lora_alpha", 8)), bool(config.get("use_rslora", False))
    pairs, rank = {}, 0
    for site, pair in halves.items():
        if set(pair) != {"A", "B"} or pair["A"].shape[0] != pair["B"].shape[1]:
            raise AdapterError(f"adapter {name!r}: layer {site[0]} {site[1]} lacks a matching lora_A/lora_B")
        r = pair["A"].shape[0]
        scaling = alpha / (math.sqrt(r) if rslora else r)
        pairs[site] = (pair["A"].to(dtype).contiguous(), (pair["B"].to(torch.float32) * scaling).to(dtype))
        rank = max(rank, r)
    return AdapterWeights(rank, alpha, rslora, pairs)
