"""A tiny Llama whose greedy next token depends on the current token only, by a script given as chains
(each token of a chain followed by the next), with the default model's tokenizer plus the added tokens of
the model families in tests/chat_templates. Its one layer adds nothing (zero output projections), so the
logits are the script's: a token that the script follows gets a large logit, every other token 0, and a
constraint's mask then picks among those. Lets a test drive the gateway's parsers with text in a family's
real format, token for token."""

import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

TEMPLATES = Path(__file__).parent / "chat_templates"
# Every family's added tokens, in one order, so that one model (one vocabulary) serves every template.
# HARMONY_FINAL spells a whole harmony header as one token (never one the tokenizer encodes text into): a
# script continues `<|channel|>` one way only (into the analysis), so it writes the final message's header
# with this token.
HARMONY_FINAL = "assistant<|channel|>final<|message|>"
ADDED = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<｜User｜>", "<｜Assistant｜>",
         "<｜end▁of▁sentence｜>", HARMONY_FINAL)  # fmt: skip
SPECIAL = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>",
           "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]", "[TOOL_RESULTS]",
           "[/TOOL_RESULTS]", "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>",
           "<|return|>", "<|call|>", "[THINK]", "[/THINK]")  # fmt: skip
HIDDEN = 128
# The logit of a scripted next token (the others' are 0).
LOGIT = 30.0


def family_tokenizer(tokenizer: PreTrainedTokenizerBase, family: str) -> PreTrainedTokenizerBase:
    """The default tokenizer (a copy) with every family's added tokens and `family`'s chat template."""
    tokenizer = type(tokenizer).from_pretrained(tokenizer.name_or_path)
    tokenizer.add_tokens(list(ADDED))
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL)})
    tokenizer.chat_template = (TEMPLATES / f"{family}.jinja").read_text()
    return tokenizer


def save_family(path: Path, tokenizer: PreTrainedTokenizerBase, family: str, model: Path) -> Path:
    """A directory holding `model`'s config and `family`'s tokenizer: what a gateway loads to serve `model`
    (started by compute) with that family's chat template."""
    family_tokenizer(tokenizer, family).save_pretrained(path)
    shutil.copy(model / "config.json", path / "config.json")
    return path


def save_scripted_model(
    path: Path, tokenizer: PreTrainedTokenizerBase, chains: Sequence[str | Sequence[str]]
) -> Path:
    """The model (with the `qwen3` family's tokenizer) following each chain, a text whose tokens (as that
    tokenizer encodes it) each lead to the next, or a list of texts of one token each (an added token's text
    names that token); a token that two chains continue differently is refused."""
    tokenizer = family_tokenizer(tokenizer, "qwen3")
    successor: dict[int, int] = {}
    for chain in chains:
        ids = _ids(tokenizer, chain)
        for current, following in zip(ids, ids[1:], strict=False):
            assert successor.setdefault(current, following) == following, (chain, tokenizer.decode([current]))
    slots = {token: slot for slot, token in enumerate(sorted(successor))}
    assert len(slots) <= HIDDEN, len(slots)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
        tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        layer = model.model.layers[0]
        for weight in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight):
            weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.lm_head.weight.zero_()
        scale = LOGIT / HIDDEN**0.5  # the normed one-hot is sqrt(HIDDEN) long
        for token, slot in slots.items():
            model.model.embed_tokens.weight[token, slot] = 1.0
            model.lm_head.weight[successor[token], slot] = scale
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def _ids(tokenizer: PreTrainedTokenizerBase, chain: str | Sequence[str]) -> list[int]:
    if isinstance(chain, str):
        return tokenizer.encode(chain, add_special_tokens=False)
    added = tokenizer.get_added_vocab()
    ids = [
        [added[piece]] if piece in added else tokenizer.encode(piece, add_special_tokens=False)
        for piece in chain
    ]
    assert all(len(one) == 1 for one in ids), chain
    return [one[0] for one in ids]
