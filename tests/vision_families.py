"""Tiny random-weight vision-language models beyond LLaVA-1.5, saved as Hugging Face directories with their
real processors built from local objects (tests/vision_model.py's tokenizer and chat template):

- LLaVA-NeXT: a CLIP tower of 30x30 tiles (6x6 patches), anyres grids of up to 2x2 tiles, image_newline; an
  image's placeholder tokens depend on its shape (135 for a 40x36 image, 85 for a 20x50 one).
- Idefics3: a SigLIP-like tower of 24x24 tiles (4x4 patches), the pixel-shuffle connector (scale 2: 9 tokens
  a tile), images split into tiles of 24 px up to 48 px, with row/column tokens and a global tile."""

from pathlib import Path

import torch
from transformers import (
    AutoTokenizer,
    CLIPVisionConfig,
    Idefics3Config,
    Idefics3ForConditionalGeneration,
    Idefics3ImageProcessorPil,
    Idefics3Processor,
    Idefics3VisionConfig,
    LlamaConfig,
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    LlavaNextImageProcessorPil,
    LlavaNextProcessor,
)

from tests.tiny_model import TINY_SHAPE
from tests.vision_model import CHAT_TEMPLATE, IMAGE_SIZE, PATCH

NEXT_GRIDS = [[IMAGE_SIZE, 2 * IMAGE_SIZE], [2 * IMAGE_SIZE, IMAGE_SIZE], [2 * IMAGE_SIZE, 2 * IMAGE_SIZE]]
TILE, TILE_PATCH, SCALE = 24, 4, 2
TILE_TOKENS = (TILE // TILE_PATCH) ** 2 // SCALE**2
IDEFICS3_TOKENS = [
    "<fake_token_around_image>",
    "<image>",
    "<end_of_utterance>",
    "<global-img>",
    *(f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)),
]


def _text_config(tokenizer) -> LlamaConfig:
    # NOTE: peaked logits (a wide initialisation), as tests/vision_model.py's
    return LlamaConfig(
        **{**TINY_SHAPE, "vocab_size": len(tokenizer), "max_position_embeddings": 1024},
        initializer_range=0.3,
        pad_token_id=0,
    )


def _save(path: Path, model, processor, tokenizer) -> Path:
    model.save_pretrained(path)
    processor.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def save_tiny_llava_next(path: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """LLaVA-NeXT's model, tokenizer and processor at `path`."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=IMAGE_SIZE,
        patch_size=PATCH,
        projection_dim=32,
    )
    config = LlavaNextConfig(
        vision_config=vision,
        text_config=_text_config(tokenizer),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        image_grid_pinpoints=NEXT_GRIDS,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlavaNextForConditionalGeneration(config)
    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE},
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        image_grid_pinpoints=NEXT_GRIDS,
    )
    processor = LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    )
    return _save(path, model, processor, tokenizer)


def save_tiny_idefics3(path: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Idefics3's model, tokenizer and processor at `path`."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": IDEFICS3_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    vision = Idefics3VisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=TILE,
        patch_size=TILE_PATCH,
    )
    config = Idefics3Config(
        vision_config=vision,
        text_config=_text_config(tokenizer),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=SCALE,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config)
    image_processor = Idefics3ImageProcessorPil(
        size={"longest_edge": 2 * TILE}, max_image_size={"longest_edge": TILE}, do_image_splitting=True
    )
    processor = Idefics3Processor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        image_seq_len=TILE_TOKENS,
        chat_template=CHAT_TEMPLATE,
    )
    return _save(path, model, processor, tokenizer)
