"""LLaVA-NeXT (anyres tiles, image_newline: each image's own number of tokens) and Idefics3 (tiles between
row and column tokens, the pixel-shuffle connector) served by `pagedserve up`, tiny random-weight models of
tests/vision_families.py: through the `openai` client, one image, two images of different shapes between
text, and a text-only request, in the same steps with prompts prefilled in chunks that end inside an
image's tokens, give transformers' greedy tokens (float32); a repeated image hits the prefix cache whole
and another image after the same text shares none of its blocks, its n = 2 samples each greedy."""

import base64
import io
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor, GenerationConfig

from cli.scrape import scrape
from tests.e2e.stack import stacks_side_by_side
from tests.vision_families import save_tiny_idefics3, save_tiny_llava_next
from tests.vision_model import png

pytestmark = pytest.mark.e2e
NEW_TOKENS = 6
# A step's budget below every image: each image prompt is prefilled in chunks, some ending inside an image.
FLAGS = ("--dtype", "float32", "--kv-blocks", "256", "--block-size", "8", "--max-batched-tokens", "16")
# The served model's name: its directory's.
MODEL = "tiny"
BUILDERS = {"llava_next": save_tiny_llava_next, "idefics3": save_tiny_idefics3}
# eos_token_id=[]: never stop early, like ignore_eos.
GREEDY = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[], pad_token_id=0)


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_dir, logs):
    """By family: (its stack, the openai client, transformers' model and processor)."""
    root = tmp_path_factory.mktemp("families")
    paths = {name: str(build(root / name / MODEL, model_dir)) for name, build in BUILDERS.items()}
    with stacks_side_by_side(logs, FLAGS, "--model", list(paths.values())) as stacks:
        clients = []
        try:
            out = {}
            for name, path in paths.items():
                api = openai.OpenAI(
                    base_url=stacks[path].http_url, api_key="unused", max_retries=0, timeout=300
                )
                clients.append(api)
                model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
                out[name] = (stacks[path], api, model, AutoProcessor.from_pretrained(path))
            yield out
        finally:
            for api in clients:
                api.close()


def content(*parts: bytes | str) -> list[dict]:
    """A user turn's parts: images (PNG bytes) and text, in order."""
    return [
        {"type": "text", "text": part}
        if isinstance(part, str)
        else {
            "type": "image_url",
            "image_url": {"url": "data:image/png;base64," + base64.b64encode(part).decode()},
        }
        for part in parts
    ]


def expected(family, *parts: bytes | str) -> tuple[list[int], list[int]]:
    """transformers' greedy tokens for the turn, and its prompt's token ids."""
    _, _, model, processor = family
    turn = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image"} for p in parts]
    prompt = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": turn}], tokenize=False, add_generation_prompt=True
    )
    images = [Image.open(io.BytesIO(p)).convert("RGB") for p in parts if isinstance(p, bytes)] or None
    inputs = processor(text=[prompt], images=images, return_tensors="pt", add_special_tokens=False)
    with torch.inference_mode():
        out = model.generate(**inputs, generation_config=GREEDY)
    ids = inputs["input_ids"][0].tolist()
    return out[0, len(ids) :].tolist(), ids


def ask(api, parts: tuple, salt: str, n: int = 1):
    return api.chat.completions.create(
        n=n,
        model=MODEL,
        messages=[{"role": "user", "content": content(*parts)}],
        max_tokens=NEW_TOKENS,
        temperature=0.0,
        extra_body={"return_token_ids": True, "ignore_eos": True, "cache_salt": salt},
    )


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_one_image_two_images_and_text_in_the_same_steps_give_transformers_greedy_tokens(served, name):
    family = served[name]
    stack, api = family[0], family[1]
    requests = [
        (png(1), "What is in this picture?"),
        ("Compare", png(2), "with", png(3, (20, 50)), "."),
        ("Name three colours.",),
    ]
    wanted = [expected(family, *parts) for parts in requests]
    assert wanted[0][0] != wanted[1][0], "the images lead the model to different tokens"
    with ThreadPoolExecutor(len(requests)) as pool:
        replies = list(pool.map(lambda parts: ask(api, parts, "steps"), requests))
    assert [reply.choices[0].model_extra["token_ids"] for reply in replies] == [w[0] for w in wanted]
    assert [reply.usage.prompt_tokens for reply in replies] == [len(w[1]) for w in wanted]
    metrics = scrape(stack.metrics_url("compute"))
    assert metrics["pagedserve_vision_images_encoded_total", ()] >= 3
    # the later chunks of a split image (or tile) find it encoded
    assert metrics["pagedserve_vision_image_cache_hits_total", ()] >= 1


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_a_repeated_image_hits_its_whole_prefix_and_another_image_shares_none_of_it(served, name):
    family = served[name]
    api, processor = family[1], family[3]
    image, other = png(4, (50, 20)), png(5, (50, 20))
    tokens, ids = expected(family, image, "Describe it.")
    ask(api, (image, "Describe it."), "repeat")
    again = ask(api, (image, "Describe it."), "repeat")
    assert again.choices[0].model_extra["token_ids"] == tokens
    assert again.usage.prompt_tokens_details.cached_tokens == len(ids) - 1, "all but the token that samples"
    changed = ask(api, (other, "Describe it."), "repeat", n=2)
    assert changed.usage.prompt_tokens_details.cached_tokens <= ids.index(processor.image_token_id)
    tokens = expected(family, other, "Describe it.")[0]
    assert [choice.model_extra["token_ids"] for choice in changed.choices] == [tokens, tokens]
