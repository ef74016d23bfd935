"""The resident adapters of one loaded model: at most `max_loras` at once, each of rank at most
`max_rank`, by name and by id. Ids are never reused, so a step naming an unloaded adapter's id is refused
rather than served by another."""

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig

from common.errors import InvalidArgument
from compute_service.lora import peft_files
from compute_service.lora.layers import TARGETS, Site, StepRows, wrap_targets
from compute_service.lora.peft_files import AdapterError
from compute_service.plan import Choice, ExecutionPlan


@dataclass(frozen=True)
class Adapter:
    """A resident adapter as GetModelInfo lists it."""

    id: int
    name: str
    path: str
    rank: int
    targets: tuple[str, ...]


class Adapters:
    """Loads adapters onto the model's wrapped targets (compute_service.lora.layers) and groups a step's
    rows by them. Load and unload run on the step thread, between steps."""

    def __init__(
        self,
        sites: dict[tuple[int, str], Site],
        dtype: torch.dtype,
        max_loras: int,
        max_rank: int,
        device: torch.device,
    ) -> None:
        self.sites, self.dtype, self.max_loras, self.max_rank = sites, dtype, max_loras, max_rank
        self.device = device
        self.by_name: dict[str, Adapter] = {}
        self.by_id: dict[int, Adapter] = {}
        # adapter id -> the slot of its weights in every LoraLinear
        self.slot_of: dict[int, int] = {}
        self._next_id = 1
        for linear in self._linears():
            linear.reserve(max_loras, max_rank, dtype, device)

    def _linears(self) -> list:
        return list({id(site.linear): site.linear for site in self.sites.values()}.values())

    @classmethod
    def on(cls, model: nn.Module, max_loras: int, max_rank: int) -> "Adapters":
        """The registry of `model`, whose target linears are wrapped here (once, last at load)."""
        return cls(wrap_targets(model), model.dtype, max_loras, max_rank, model.device)

    def load(self, name: str, path: str) -> Adapter:
        """Reads the PEFT directory at `path`, checks it against the model and the limits and makes it
        resident as `name`; AdapterError (nothing changed) when it cannot be."""
        if not name or name in self.by_name:
            raise AdapterError(f"adapter name {name!r} is {'taken' if name else 'empty'}: name it otherwise")
        if len(self.by_name) >= self.max_loras:
            raise AdapterError(
                f"adapter {name!r}: {self.max_loras} adapters are resident (--max-loras): unload one first"
            )
        weights = peft_files.read(name, path, self.dtype)
        _check_rank(name, weights.rank, self.max_rank)
        self._check(name, weights.pairs)
        slot = min(set(range(self.max_loras)) - set(self.slot_of.values()))
        adapter = Adapter(self._next_id, name, str(Path(path)), weights.rank, tuple(weights.targets))
        self._next_id += 1
        by_linear: dict[int, tuple[Site, list]] = {}
        for key, (a, b) in weights.pairs.items():
            site = self.sites[key]
            by_linear.setdefault(id(site.linear), (site, []))[1].append((site.piece, a, b))
        for site, pieces in by_linear.values():
            site.linear.add(slot, pieces)
        self.by_name[name], self.by_id[adapter.id], self.slot_of[adapter.id] = adapter, adapter, slot
        return adapter

    def unload(self, name: str) -> Adapter:
        """Drops the adapter `name`; KeyError when none is resident by that name."""
        adapter = self.by_name.pop(name)
        del self.by_id[adapter.id]
        slot = self.slot_of.pop(adapter.id)
        for linear in self._linears():
            linear.remove(slot)
        return adapter

    def rows(self, adapter_ids: torch.Tensor, cu_seqlens_q: torch.Tensor) -> StepRows | None:
        """A step's rows grouped by adapter (ForwardRequest.lora_ids); InvalidArgument for an id that is
        not resident."""
        unknown = sorted(set(adapter_ids.tolist()) - {0} - set(self.by_id))
        if unknown:
            raise InvalidArgument(
                f"lora_ids {unknown} name no resident adapter (GetModelInfo.lora_adapters lists them)"
            )
        slots = torch.tensor([self.slot_of.get(adapter, -1) for adapter in adapter_ids.tolist()])
        rows = StepRows.of(slots, cu_seqlens_q)
        return None if rows is None else rows.to(self.device)

    def _check(self, name: str, pairs: dict) -> None:
        served = sorted({target for _, target in self.sites})
        for (layer, target), (a, b) in sorted(pairs.items()):
            site = self.sites.get((layer, target))
            if site is None:
                raise AdapterError(
                    f"adapter {name!r} targets {target} of layer {layer}, which this model does not have "
                    f"as a LoRA target (its targets: {', '.join(served)})"
                )
            out, inputs = site.shape
            if a.shape[1] != inputs or b.shape[0] != out:
                raise AdapterError(
                    f"adapter {name!r}: layer {layer} {target} is [{b.shape[0]}, {a.shape[1]}] in the "
                    f"adapter but [{out}, {inputs}] in the model: it was trained on another base"
                )


def plan_choice(plan: ExecutionPlan) -> Choice:
    """The execution plan's `lora` stage: which path a step's adapter rows run on."""
    stack = (
        " and keep all-decode steps with adapter rows off the native decode stack"
        if plan.native_decode
        else ""
    )
    return Choice(
        f"segmented shrink/expand on the {plan.layers.implementation} layers",
        "each target linear adds one x·Aᵀ·Bᵀ product per adapter in the step over that adapter's rows "
        f"(compute_service/lora){stack}; steps of base rows only run as planned",
    )


def from_flags(
    model: nn.Module, enable: bool, modules: list[str] | None, max_loras: int, max_rank: int
) -> Adapters | None:
    """The model's adapters as compute's flags set them, those of --lora-modules (NAME=DIR) resident; None
    when LoRA is off. AdapterError when an adapter does not fit (the flags are checked by check_flags)."""
    if not enable and not modules:
        return None
    adapters = Adapters.on(model, max_loras, max_rank)
    for module in modules or ():
        name, _, path = module.partition("=")
        adapters.load(name, path)
    return adapters


def check_flags(
    config: PretrainedConfig, enable: bool, modules: list[str] | None, max_loras: int, max_rank: int
) -> None:
    """The LoRA flags and every adapter of --lora-modules checked against the base model's config.json
    before the model loads (its files and safetensors header only, no weights read): the limits, the
    names, each adapter's rank, layers and target shapes. AdapterError naming the first that does not fit;
    from_flags checks the loaded model's targets again."""
    if not enable and not modules:
        return
    if max_loras < 1 or max_rank < 1:
        raise AdapterError(f"--max-loras ({max_loras}) and --max-lora-rank ({max_rank}) must be at least 1")
    names = [module.partition("=")[0] for module in modules or ()]
    if len(names) > max_loras:
        raise AdapterError(
            f"--lora-modules names {len(names)} adapters, over --max-loras {max_loras}: raise --max-loras"
        )
    text = config.get_text_config()
    shapes, layers = target_shapes(text), text.num_hidden_layers
    for module in modules or ():
        name, _, path = module.partition("=")
        if not name or names.count(name) > 1:
            raise AdapterError(f"adapter name {name!r} is {'taken' if name else 'empty'}: name it otherwise")
        declared = peft_files.inspect(name, path)
        _check_rank(name, declared.rank, max_rank)
        for (layer, target), pair in sorted(declared.halves.items()):
            if layer >= layers:
                raise AdapterError(
                    f"adapter {name!r} targets layer {layer}, but the model has {layers} layers: it was "
                    "trained on another base"
                )
            if target not in shapes:
                raise AdapterError(
                    f"adapter {name!r} targets {target} of layer {layer}, which is not a LoRA target "
                    f"(served: {', '.join(TARGETS)})"
                )
            out, inputs = shapes[target]
            (_, a), (_, b) = pair["A"], pair["B"]
            if (out is not None and b[0] != out) or (inputs is not None and a[1] != inputs):
                raise AdapterError(
                    f"adapter {name!r}: layer {layer} {target} is [{b[0]}, {a[1]}] in the adapter but "
                    f"[{out or '?'}, {inputs or '?'}] in the model's config.json: it was trained on another "
                    "base"
                )


def target_shapes(config: PretrainedConfig) -> dict[str, tuple[int | None, int]]:
    """Each target module's weight shape [out, in] as a decoder layer of `config` has it (out None where
    the config does not fix it: an MoE model's MLP, whose targets the loaded model decides)."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    dense = not any(getattr(config, key, None) for key in ("num_local_experts", "num_experts"))
    inner = config.intermediate_size if dense else None
    return {
        "q_proj": (heads * head_dim, hidden),
        "k_proj": (kv * head_dim, hidden),
        "v_proj": (kv * head_dim, hidden),
        "o_proj": (hidden, heads * head_dim),
        "qkv_proj": ((heads + 2 * kv) * head_dim, hidden),
        "gate_proj": (inner, hidden),
        "up_proj": (inner, hidden),
        "down_proj": (hidden, inner) if dense else (None, None),
        "gate_up_proj": (2 * inner if dense else None, hidden),
    }


def _check_rank(name: str, rank: int, max_rank: int) -> None:
    if rank > max_rank:
        raise AdapterError(f"adapter {name!r} has rank {rank}, over --max-lora-rank {max_rank}")
