"""How a model pools a sequence's hidden states into one embedding: what its directory declares
(sentence-transformers' modules.json: a Transformer, then a Pooling module whose config names the mode, then
optionally a Normalize), or what --pooling sets; and the pooling of a step's rows.

A plain causal LM declares nothing and does not pool unless --pooling names a mode; `last` is the one a
decoder embedding model is trained for (its last token is the only one that has seen the whole input).
Matryoshka truncation is allowed where the model's config.json says so, as vLLM reads it: `is_matryoshka`
(any width) or `matryoshka_dimensions` (those widths).
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PretrainedConfig

from compute_service import scoring

# sentence-transformers' Pooling modes (its config's `pooling_mode`, or the legacy `pooling_mode_*` flags)
# that pagedserve runs, by its own names.
_ST_MODES = {"lasttoken": "last", "mean": "mean", "cls": "cls"}
_ST_LEGACY = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_MODULES = ("Transformer", "Pooling", "Normalize")


class UnsupportedPooling(ValueError):
    """The model declares a pooling pagedserve does not run; the message says what it runs."""


@dataclass(frozen=True)
class Pooling:
    """`mode`: last, mean or cls; `normalize`: unit length after any truncation; `dimensions`: the hidden
    size; `matryoshka`: None, no truncation; empty, any width; else the widths allowed; `source`: where it
    was declared ("modules.json" or "--pooling")."""

    mode: str
    normalize: bool
    dimensions: int
    matryoshka: tuple[int, ...] | None
    source: str


def resolve(
    flag: str, model_dir: Path, config: PretrainedConfig, from_tokens: bool = False
) -> Pooling | None:
    """The pooling compute serves under --pooling `flag`: a scoring model's (compute_service.scoring: the
    last token, scored; `from_tokens`: --classifier-from-token makes a causal LM one); auto, what the model
    declares (None if nothing); off, None; a mode, that mode, normalised unless the model's modules.json
    lists no Normalize module. UnsupportedPooling for a declaration pagedserve cannot follow (under auto)."""
    if flag == "off":
        return None
    if scoring.classifies(config, from_tokens):
        if flag not in ("auto", "last"):
            raise UnsupportedPooling(
                f"--pooling {flag}: a sequence-classification model scores from its last token; start "
                "it with --pooling auto"
            )
        return Pooling("last", False, 1, None, "score")
    if flag == "auto":
        declared = _declared(model_dir)
        if declared is None:
            return None
        (mode, normalize), source = declared, "modules.json"
    else:
        mode, normalize, source = flag, _normalizes(model_dir), "--pooling"
    return Pooling(mode, normalize, config.hidden_size, _matryoshka(config), source)


def _normalizes(model_dir: Path) -> bool:
    """Whether an explicit --pooling normalises: unless a modules.json lists modules without Normalize."""
    path = model_dir / "modules.json"
    return not path.exists() or any(m["type"].endswith(".Normalize") for m in json.loads(path.read_text()))


def _declared(model_dir: Path) -> tuple[str, bool] | None:
    """(mode, normalize) from a sentence-transformers modules.json, or None when there is none."""
    path = model_dir / "modules.json"
    if not path.exists():
        return None
    modules = json.loads(path.read_text())
    kinds = [module["type"].rsplit(".", 1)[-1] for module in modules]
    if any(kind not in _MODULES for kind in kinds) or "Pooling" not in kinds or kinds[0] != "Transformer":
        raise UnsupportedPooling(
            f"{path} lists the modules {kinds}: pagedserve runs a Transformer, then Pooling, then optionally "
            "Normalize (no Dense or other modules)"
        )
    _check_text_modality(model_dir / "sentence_bert_config.json")
    pooling = next(module for module in modules if module["type"].endswith(".Pooling"))
    return _mode(model_dir / pooling["path"] / "config.json"), "Normalize" in kinds


def _check_text_modality(path: Path) -> None:
    """UnsupportedPooling where sentence-transformers would render text through the chat template (its
    Transformer module's "message" modality, saved by version 6 for a tokenizer with a chat template):
    pagedserve embeds text as the tokenizer encodes it."""
    modalities = json.loads(path.read_text()).get("modality_config", {}) if path.exists() else {}
    if "message" in modalities:
        raise UnsupportedPooling(
            f"{path} renders text through the chat template (modality_config 'message'): pagedserve embeds "
            "text as the tokenizer encodes it; save the model with a text modality only, or start compute "
            "with --pooling last (mean, cls) to embed it so"
        )


def _mode(path: Path) -> str:
    settings = json.loads(path.read_text())
    modes = settings.get("pooling_mode", [mode for key, mode in _ST_LEGACY.items() if settings.get(key)])
    modes = [modes] if isinstance(modes, str) else list(modes)
    include_prompt = settings.get("include_prompt", True)
    if len(modes) != 1 or modes[0] not in _ST_MODES or not include_prompt:
        raise UnsupportedPooling(
            f"{path} asks for pooling {modes or 'by no mode'} (include_prompt {include_prompt}): pagedserve "
            "pools by one of lasttoken, mean or cls, prompt included"
        )
    return _ST_MODES[modes[0]]


def _matryoshka(config: PretrainedConfig) -> tuple[int, ...] | None:
    widths = getattr(config, "matryoshka_dimensions", None)
    if widths:
        return tuple(sorted(int(width) for width in widths))
    return () if getattr(config, "is_matryoshka", False) else None


def pool(mode: str, hidden: torch.Tensor, cu_seqlens_q: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """hidden [T, H] of a packed step -> [len(rows), H] float32, per row of `rows`: the last new token's
    hidden state (last), the first's (cls), or the sum of all its new tokens' (mean: the caller divides, once
    it has every chunk of the sequence)."""
    index = torch.tensor(rows, dtype=torch.int64)
    starts, ends = cu_seqlens_q[index], cu_seqlens_q[index + 1]
    if mode == "last":
        return hidden[(ends - 1).to(hidden.device)].float().cpu()
    if mode == "cls":
        return hidden[starts.to(hidden.device)].float().cpu()
    lengths = ends - starts
    tokens = torch.repeat_interleave(starts - torch.cumsum(lengths, 0) + lengths, lengths) + torch.arange(
        int(lengths.sum())
    )
    owner = torch.repeat_interleave(torch.arange(len(rows)), lengths)
    picked = hidden[tokens.to(hidden.device)].float().cpu()
    return torch.zeros(len(rows), hidden.shape[1]).index_add_(0, owner, picked)
