"""A vision-language model (a tiny random-weight LLaVA-1.5) served by `pagedserve up`: chat messages with
images, sent through the `openai` client as data: URLs, give transformers' greedy tokens (float32), alone,
beside a text-only request and another image in the same steps, with prompts prefilled in chunks that split
inside an image's tokens, and with n > 1; a repeated image hits the prefix cache past the image while another
image after the same text never shares its blocks; bad images are refused with a 400 that names them. The
same image fetched from an allowed host (a local HTTP server), read from the allowed directory, or sent as a
Messages API image block through the `anthropic` client gives the same tokens as its data: URL."""

import base64
import functools
import io
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import anthropic
import openai
import pytest
import torch
from PIL import Image
from transformers import GenerationConfig

from cli.scrape import scrape
from tests.helpers import PAGEDSERVE
from tests.vision_model import IMAGE_TOKENS, png, save_tiny_llava
from tests.vision_requests import serving

pytestmark = pytest.mark.e2e
NEW_TOKENS = 6
BLOCK = 8
# A step's budget below every image prompt: each is prefilled in chunks, one of which ends inside the image.
FLAGS = ("--dtype", "float32", "--kv-blocks", "256", "--block-size", str(BLOCK), "--max-batched-tokens", "16")
QUESTION = "What is in this picture?"
MODEL = "tiny-llava"
# eos_token_id=[]: never stop early, like ignore_eos.
GREEDY = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=[], pad_token_id=0)


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """(the directory image files may be read from, the URL of a local HTTP server serving it)."""
    root = tmp_path_factory.mktemp("media")
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(root)))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_dir, logs, media):
    """(model directory, its stack, the openai client, transformers' model and processor)."""
    path = save_tiny_llava(tmp_path_factory.mktemp("vision") / MODEL, model_dir)
    allowed = ("--allowed-local-media-path", str(media[0]), "--allowed-media-domains", "127.0.0.1")
    with serving(path, logs, *FLAGS, *allowed) as parts:
        yield parts


def data_url(image: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(image).decode()


def chat(image: bytes | None, text: str = QUESTION) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(image)}}] if image else []
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def expected(served, image: bytes | None, text: str = QUESTION) -> tuple[list[int], list[int]]:
    """transformers' greedy tokens for the chat, and its prompt's token ids."""
    _, _, reference, processor = served
    conversation = [
        {"role": "user", "content": [*([{"type": "image"}] if image else []), {"type": "text", "text": text}]}
    ]
    prompt = processor.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    images = [Image.open(io.BytesIO(image)).convert("RGB")] if image else None
    inputs = processor(text=[prompt], images=images, return_tensors="pt", add_special_tokens=False)
    with torch.inference_mode():
        out = reference.generate(**inputs, generation_config=GREEDY)
    ids = inputs["input_ids"][0].tolist()
    return out[0, len(ids) :].tolist(), ids


def ask(api, messages: list[dict], salt: str = "", **extra):
    body = {"return_token_ids": True, "ignore_eos": True, **({"cache_salt": salt} if salt else {})}
    return api.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=NEW_TOKENS, temperature=0.0, extra_body=body, **extra
    )


def token_ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def test_an_image_chat_gives_transformers_greedy_tokens(served):
    _, api, _, _ = served
    image = png(1)
    tokens, ids = expected(served, image)
    reply = ask(api, chat(image), salt="one")
    assert reply.usage.prompt_tokens == len(ids) and ids.count(served[3].image_token_id) == IMAGE_TOKENS
    assert token_ids(reply.choices[0]) == tokens


def test_images_and_text_in_the_same_steps_give_their_own_tokens(served):
    _, api, _, _ = served
    requests = [(png(2), QUESTION), (png(3), QUESTION), (None, "Name three colours.")]
    wanted = [expected(served, image, text)[0] for image, text in requests]
    assert wanted[0] != wanted[1], "the two images lead the model to different tokens"
    with ThreadPoolExecutor(len(requests)) as pool:
        replies = list(pool.map(lambda r: ask(served[1], chat(*r), salt="same-steps"), requests))
    assert [token_ids(reply.choices[0]) for reply in replies] == wanted


def test_a_repeated_image_hits_the_prefix_cache_and_another_image_does_not(served):
    stack, api, _, _ = served
    first, other = png(4), png(5)
    tokens, ids = expected(served, first)
    ask(api, chat(first), salt="repeat")
    again = ask(api, chat(first), salt="repeat")
    assert token_ids(again.choices[0]) == tokens
    assert again.usage.prompt_tokens_details.cached_tokens == len(ids) - 1, "all but the token that samples"
    # the same text, another image: what comes before the image's first token is shared, nothing after
    changed = ask(api, chat(other), salt="repeat")
    assert changed.usage.prompt_tokens_details.cached_tokens == ids.index(served[3].image_token_id)
    assert token_ids(changed.choices[0]) == expected(served, other)[0]
    metrics = scrape(stack.metrics_url("compute"))
    assert metrics["pagedserve_vision_images_encoded_total", ()] >= 3
    # chunks after the first of a split image find it encoded
    assert metrics["pagedserve_vision_image_cache_hits_total", ()] >= 1


def test_n_samples_of_an_image_chat_each_give_the_greedy_tokens(served):
    _, api, _, _ = served
    image = png(6)
    reply = ask(api, chat(image), salt="n", n=2)
    tokens, _ = expected(served, image)
    assert [token_ids(choice) for choice in reply.choices] == [tokens, tokens]


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "image 0 cannot be decoded"),
        ("https://example.com/cat.png", "host example.com is not in --allowed-media-domains"),
        ("file:///etc/passwd", "/etc/passwd is not under --allowed-local-media-path"),
        ("data:image/png;base64,@@@", "base64 does not decode"),
    ],
)
def test_a_bad_image_is_a_400_naming_it(served, url, says):
    _, api, _, _ = served
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
    with pytest.raises(openai.BadRequestError) as caught:
        ask(api, messages)
    assert says in caught.value.message


def image_part(image: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(image)}}


def test_too_many_images_and_a_decompression_bomb_are_refused_before_decoding(served):
    _, api, _, _ = served
    bomb = io.BytesIO()
    Image.new("L", (5001, 5001)).save(bomb, format="PNG")
    refusals = [
        ([image_part(png(1, (8, 8)))] * 9, "images has 9 entries; the limit is 8 (--max-images-per-prompt)"),
        ([image_part(bomb.getvalue())], "image 0 is 5001x5001 pixels; the limit is 25000000 pixels"),
    ]
    for content, says in refusals:
        with pytest.raises(openai.BadRequestError) as caught:
            ask(api, [{"role": "user", "content": content}])
        assert says in caught.value.message


def test_an_image_from_an_allowed_host_or_directory_gives_its_data_url_tokens(served, media):
    _, api, _, _ = served
    root, origin = media
    image = png(9)
    (root / "nine.png").write_bytes(image)
    urls = (data_url(image), f"{origin}/nine.png", f"file://{root}/nine.png")
    parts = [[{"type": "image_url", "image_url": {"url": url}}] for url in urls]
    replies = [ask(api, [{"role": "user", "content": part}], salt=f"url{i}") for i, part in enumerate(parts)]
    assert len({reply.usage.prompt_tokens for reply in replies}) == 1
    assert token_ids(replies[1].choices[0]) == token_ids(replies[0].choices[0])
    assert token_ids(replies[2].choices[0]) == token_ids(replies[0].choices[0])


def test_a_messages_api_image_block_gives_the_chat_completions_tokens(served):
    stack, api, _, _ = served
    image = png(10)
    chat_reply = api.chat.completions.create(
        model=MODEL, messages=chat(image), max_tokens=NEW_TOKENS, temperature=0.0
    )
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(image).decode()}
    content = [{"type": "image", "source": source}, {"type": "text", "text": QUESTION}]
    with anthropic.Anthropic(
        base_url=stack.http_url.removesuffix("/v1"), api_key="unused", max_retries=0, timeout=300
    ) as client:
        message = client.messages.create(
            model=MODEL,
            max_tokens=NEW_TOKENS,
            extra_body={"temperature": 0.0},
            messages=[{"role": "user", "content": content}],
        )
        with pytest.raises(anthropic.BadRequestError) as caught:
            client.messages.create(
                model=MODEL,
                max_tokens=NEW_TOKENS,
                messages=[
                    {"role": "user", "content": [{"type": "image", "source": {**source, "data": "@@"}}]}
                ],
            )
    # The same prompt: the Messages API's input tokens leave out those read from the prefix cache.
    usage = message.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat_reply.usage.prompt_tokens
    assert message.usage.output_tokens == chat_reply.usage.completion_tokens
    assert message.content[0].text == chat_reply.choices[0].message.content
    assert "messages[0].content[0].source.data: the base64 does not decode" in caught.value.message


def test_the_sdk_sends_image_parts_over_grpc(served):
    stack = served[0]
    image = png(7)
    message = {
        "role": "user",
        "content": [{"type": "image", "image": image}, {"type": "text", "text": QUESTION}],
    }
    with stack.client() as client:
        result = client.generate(messages=[message], max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    assert result.token_ids == expected(served, image)[0]


def test_the_generate_command_sends_image_files(served, tmp_path):
    stack, _, _, processor = served
    image = tmp_path / "picture.png"
    image.write_bytes(png(8))
    out = subprocess.run(
        [*PAGEDSERVE, "generate", QUESTION, "--image", str(image), "--max-tokens", str(NEW_TOKENS),
         "--temperature", "0", "--ignore-eos", "--target", stack.target],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    tokens, ids = expected(served, image.read_bytes())
    assert out.stdout.rstrip("\n") == processor.tokenizer.decode(tokens, skip_special_tokens=True).rstrip(
        "\n"
    )
    assert f"{len(ids)} prompt tokens" in out.stderr
    missing = subprocess.run(
        [*PAGEDSERVE, "generate", QUESTION, "--image", str(tmp_path / "none.png"), "--target", stack.target],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert missing.returncode == 2 and "cannot read --image" in missing.stderr
