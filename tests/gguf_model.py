"""A tiny random-weight Qwen2 (its QKV biases drawn too) written as a GGUF file (float32 tensors, named by
gguf's own map), with the default model's tokenizer and chat template copied from its GGUF: what a user's
GGUF of an architecture other than Llama looks like to `--model FILE.gguf`."""

from pathlib import Path

import numpy as np
import torch
from gguf import MODEL_ARCH, GGUFReader, GGUFValueType, GGUFWriter, get_tensor_name_map
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen2Config

from common.model_files import DEFAULT_MODEL, resolve
from tests.architectures import BASE, draw_biases_and_head_norms

WRITERS = {
    GGUFValueType.ARRAY: GGUFWriter.add_array,
    GGUFValueType.STRING: GGUFWriter.add_string,
    GGUFValueType.UINT32: GGUFWriter.add_uint32,
    GGUFValueType.BOOL: GGUFWriter.add_bool,
}


def save_tiny_qwen2_gguf(path: Path, seed: int = 0) -> PreTrainedModel:
    """Writes the GGUF at `path`; returns the same weights as a transformers model (the reference)."""
    source = GGUFReader(str(resolve(DEFAULT_MODEL)))
    tokenizer = {key: field for key, field in source.fields.items() if key.startswith("tokenizer.")}
    vocab = len(tokenizer["tokenizer.ggml.tokens"].data)
    config = Qwen2Config(**{**BASE, "vocab_size": vocab}, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    draw_biases_and_head_norms(model)
    writer = GGUFWriter(str(path), "qwen2")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_embedding_length(config.hidden_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(vocab)
    for key, field in tokenizer.items():
        WRITERS[field.types[0]](writer, key, field.contents())
    names = get_tensor_name_map(MODEL_ARCH.QWEN2, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        module, kind = name.rsplit(".", 1)
        writer.add_tensor(f"{names.get_name(module)}.{kind}", tensor.numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model
