"""Chat requests with one image for the tiny LLaVA (tests/vision_model.py), and transformers' greedy tokens
for them (float32): the reference a served image chat must give."""

import base64
import contextlib
import io
from collections.abc import Iterator
from pathlib import Path

import openai
import torch
from PIL import Image
from transformers import AutoProcessor, GenerationConfig, LlavaForConditionalGeneration

from tests.e2e.stack import start_stack

QUESTION = "What is in this picture?"


def chat(image: bytes, text: str = QUESTION) -> list[dict]:
    """One user message: the image as a data: URL, then the text."""
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    return [
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}],
        }
    ]


def greedy_reference(reference, processor, image: bytes, new_tokens: int, text: str = QUESTION) -> list[int]:
    """transformers' greedy tokens for `chat(image, text)`, never stopping early (like ignore_eos)."""
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    prompt = processor.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    pixels = [Image.open(io.BytesIO(image)).convert("RGB")]
    inputs = processor(text=[prompt], images=pixels, return_tensors="pt", add_special_tokens=False)
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=[], pad_token_id=0)
    with torch.inference_mode():
        out = reference.generate(**inputs, generation_config=config)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


@contextlib.contextmanager
def serving(path: Path, logs: Path, *flags: str) -> Iterator[tuple]:
    """A stack serving the tiny LLaVA saved at `path` with `flags`: (the stack, the `openai` client on it,
    transformers' model and processor of the same files); the stack stops cleanly at the end."""
    stack = start_stack(logs, "--model", str(path), *flags)
    reference = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(path)
    with openai.OpenAI(base_url=stack.http_url, api_key="unused", max_retries=0, timeout=300) as api:
        yield stack, api, reference, processor
    assert stack.stop() == 0
