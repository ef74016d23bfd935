"""A tiny random-weight LLaVA-1.5 saved as a Hugging Face directory: a CLIP vision tower (30x30 images, 6x6
patches: 25 image tokens), the two-layer projector and a Llama text model, SmolLM2's tokenizer with an
`<image>` token added, the processor (CLIP's Pillow image transforms) and a chat template that renders image
parts where they stand; and small test images."""

import io
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import (
    AutoTokenizer,
    CLIPImageProcessorPil,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
)

from tests.tiny_model import TINY_SHAPE

IMAGE_SIZE, PATCH = 30, 6
IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2
# Each message's parts in order, an image as `<image>` on a line of its own; text content as it is.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}{{ message['role'].upper() }}: "
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}<image>\n{%- else -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif %}\n{% endfor -%}"
    "{%- if add_generation_prompt -%}ASSISTANT:{%- endif -%}"
)


def save_tiny_llava(
    path: Path, tokenizer_dir: Path, seed: int = 0, image_size: int = IMAGE_SIZE, patch: int = PATCH, **tower
) -> Path:
    """The model, tokenizer and processor at `path`; `image_size`, `patch` and `tower` (CLIPVisionConfig
    fields) make a larger vision tower than the tests' (a measurement's)."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    # NOTE: peaked logits (a wide initialisation), so that greedy picks are clear; the vocabulary covers
    # the tokenizer's, so chat messages can be sent.
    text = LlamaConfig(
        **{**TINY_SHAPE, "vocab_size": len(tokenizer), "max_position_embeddings": 1024},
        initializer_range=0.3,
        pad_token_id=0,
    )
    shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}
    vision = CLIPVisionConfig(
        **{**shape, **tower}, image_size=image_size, patch_size=patch, projection_dim=32
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_id=image_token_id,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        image_seq_length=(image_size // patch) ** 2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    LlavaForConditionalGeneration(config).save_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=patch,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def png(seed: int, size: tuple[int, int] = (40, 36)) -> bytes:
    """A random RGB image, PNG-encoded."""
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()
