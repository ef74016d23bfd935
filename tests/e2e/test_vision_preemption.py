"""Preemption and recompute with images: concurrent image chats (the tiny random-weight LLaVA-1.5 of
test_vision.py) behind a KV pool too small for them all run out of blocks; the preempted ones, mid-decode
and mid-prompt inside their image's tokens, are computed again from their prompt with the image's
embeddings scattered again (no prefix cache to skip them), read from compute's encoder cache, and each
still gives transformers' greedy tokens (float32)."""

import io
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from PIL import Image
from transformers import GenerationConfig

from cli.scrape import scrape
from tests.e2e.stack import preemptions
from tests.helpers import log_events
from tests.vision_model import IMAGE_TOKENS, png, save_tiny_llava
from tests.vision_requests import QUESTION, chat, serving

pytestmark = pytest.mark.e2e
NEW_TOKENS = 24
REQUESTS = 4
MODEL = "tiny-llava"
# NOTE: an image chat is 45 prompt tokens (6 blocks of 8), 9 blocks with its new tokens: 14 blocks hold
# one whole and the start of another, so four at once outgrow them while prefilling and decoding; chunks of
# 16 tokens end inside the image's tokens (positions 3-27).
FLAGS = ("--dtype", "float32", "--kv-blocks", "14", "--block-size", "8", "--max-batched-tokens", "16",
         "--no-prefix-cache", "--log-format", "json")  # fmt: skip
GREEDY = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[], pad_token_id=0)


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_dir, logs):
    """(its stack, the openai client, transformers' model and processor)."""
    path = save_tiny_llava(tmp_path_factory.mktemp("vision") / MODEL, model_dir)
    with serving(path, logs, *FLAGS) as parts:
        yield parts


def expected(reference, processor, image: bytes) -> tuple[list[int], list[int]]:
    """transformers' greedy tokens for the image chat, and its prompt's token ids."""
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    prompt = processor.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    images = [Image.open(io.BytesIO(image)).convert("RGB")]
    inputs = processor(text=[prompt], images=images, return_tensors="pt", add_special_tokens=False)
    with torch.inference_mode():
        out = reference.generate(**inputs, generation_config=GREEDY)
    ids = inputs["input_ids"][0].tolist()
    return out[0, len(ids) :].tolist(), ids


def ask(api, image: bytes):
    return api.chat.completions.create(
        model=MODEL,
        messages=chat(image),
        max_tokens=NEW_TOKENS,
        temperature=0.0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )


def vision_counts(stack) -> tuple[float, float]:
    """(images compute has encoded, images it found encoded already) so far."""
    metrics = scrape(stack.metrics_url("compute"))
    return tuple(
        metrics[f"pagedserve_vision_{name}_total", ()] for name in ("images_encoded", "image_cache_hits")
    )


def test_preempted_image_chats_are_recomputed_with_their_images(served):
    stack, api, reference, processor = served
    images = [png(20 + i) for i in range(REQUESTS)]
    wanted = [expected(reference, processor, image) for image in images]
    ids = wanted[0][1]
    first = ids.index(processor.image_token_id)
    assert ids.count(processor.image_token_id) == IMAGE_TOKENS
    assert len({tuple(tokens) for tokens, _ in wanted}) == REQUESTS, "each image leads to its own tokens"
    before, counts = preemptions(stack), vision_counts(stack)
    with ThreadPoolExecutor(REQUESTS) as pool:
        replies = list(pool.map(lambda image: ask(api, image), images))
    served = [reply.choices[0].model_extra["token_ids"] for reply in replies]
    assert served == [tokens for tokens, _ in wanted]
    assert preemptions(stack) > before, "the pool is meant to run out"
    computed = [
        n
        for event in log_events(stack.proc.log_path)
        if event["event"] == "preempted"
        for n in event["computed"]
    ]
    assert any(n >= len(ids) for n in computed), f"none preempted mid-decode: {computed}"
    assert any(first < n < first + IMAGE_TOKENS for n in computed), (
        f"none preempted inside the image: {computed}"
    )
    # With no prefix cache, each recompute of a sequence preempted past its image's first token covers the
    # image again: compute finds its embeddings in its encoder cache; each image is encoded once.
    encoded, hits = (now - then for now, then in zip(vision_counts(stack), counts, strict=True))
    assert encoded == REQUESTS
    assert hits >= sum(n > first for n in computed), (hits, computed)
    stats = stack.stats()
    assert (stats.used_blocks, stats.num_sequences) == (0, 0)
