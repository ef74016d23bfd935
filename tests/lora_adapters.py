"""PEFT LoRA adapters of a saved model, written by peft itself (adapter_config.json and
adapter_model.safetensors), with random non-zero A and B so that each changes the model's tokens."""

from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from tests.architectures import save_tiny

LLAMA_ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
LLAMA_MLP = ["gate_proj", "up_proj", "down_proj"]


def save_adapter(
    model_dir: Path, path: Path, rank: int, targets: list[str], seed: int, alpha: float = 16, rslora=False
) -> Path:
    """A LoRA adapter of the model at `model_dir`, of `rank` on `targets`, saved at `path`."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, init_lora_weights=False
    )
    model = get_peft_model(base, config)
    model.save_pretrained(path)
    return path


def save_tiny_with_adapters(
    root: Path, architecture: str, tokenizer, adapters: dict[str, tuple[int, list[str], bool]]
) -> tuple[Path, dict[str, Path]]:
    """The random-weight model of `architecture` with `tokenizer` at root/model, and per name -> (rank,
    targets, rsLoRA) an adapter of it at root/name, seeded by its place in `adapters`."""
    model_dir = save_tiny(architecture, root / "model")
    tokenizer.save_pretrained(model_dir)
    paths = {
        name: save_adapter(model_dir, root / name, rank, targets, seed=i, rslora=rslora)
        for i, (name, (rank, targets, rslora)) in enumerate(adapters.items())
    }
    return model_dir, paths


def peft_model(model_dir: Path, adapters: dict[str, Path]) -> PeftModel:
    """transformers' eager model of `model_dir` with every adapter loaded under its name (set_adapter picks
    one; `disable_adapter()` gives the base)."""
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    names = iter(adapters.items())
    first, path = next(names)
    model = PeftModel.from_pretrained(base, path, adapter_name=first)
    for name, path in names:
        model.load_adapter(path, adapter_name=name)
    return model.eval()


@torch.no_grad()
def merged_hidden(model_dir: Path, adapter: Path | None, prompt: list[int]) -> torch.Tensor:
    """The final hidden states [T, hidden] (after the last norm) of `prompt` in transformers' model of
    `model_dir` with the adapter at `adapter` merged into its weights by peft (None: the base model)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    return model.eval().model(torch.tensor([prompt])).last_hidden_state[0]
