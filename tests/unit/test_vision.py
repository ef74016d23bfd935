"""Images on the CPU, without services: the encoder budget's chunk cuts, the ids the prefix cache sees at an
image's positions, data: URLs, compute's checks of a step's images and the refusal of vision-language
families not served."""

from dataclasses import replace

import pytest
import torch
from transformers import LlavaForConditionalGeneration, Qwen2VLConfig

from common.errors import InvalidArgument
from common.model_files import local_copy
from compute_service import architectures
from compute_service import vision as compute_vision
from compute_service.model_loader import plan_for
from compute_service.planning import Flags
from gateway import tokenizer as tok
from gateway.http.errors import HttpError
from gateway.http.image_parts import DATA_ONLY
from gateway.sequence import Sampling, Sequence
from gateway.vision import EncoderBudget, SeqImage, encode_prompt
from protos import compute_pb2, generation_pb2
from tests.scheduling import make, run
from tests.scheduling import seq as scheduled_seq
from tests.vision_model import IMAGE_SIZE, IMAGE_TOKENS, save_tiny_llava

IMAGE_TOKEN = 9
PIXELS = compute_pb2.ImageTensor(name="pixel_values", shape=[3, 2, 2], data=bytes(4 * 12))


def image(offset: int, num_tokens: int, digest: bytes = b"a" * 16) -> SeqImage:
    return SeqImage.of(offset, num_tokens, digest, (PIXELS,))


def seq(*images: SeqImage, chunk_start: int = 0) -> Sequence:
    s = Sequence("s", list(range(100)), Sampling(), 200, images=images)
    s.num_computed = chunk_start
    return s


def test_a_chunk_stops_before_an_image_beyond_the_budget_unless_the_step_has_none():
    budget = EncoderBudget(30)
    budget.start_step()
    assert budget.fit(seq(image(10, 25)), 50) == 50, "the first image runs"
    assert budget.fit(seq(image(5, 25)), 50) == 5, "the second stops before its image"
    budget.start_step()
    assert budget.fit(seq(image(0, 40)), 50) == 50, "an image over the budget runs in a step of its own"
    assert budget.fit(seq(image(30, 5), chunk_start=32), 10) == 0, "the rest of an image waits whole"
    unlimited = EncoderBudget(0)
    unlimited.start_step()
    assert [unlimited.fit(seq(image(0, 40)), 50) for _ in range(3)] == [50, 50, 50]


def test_the_cache_sees_an_images_positions_as_ids_of_its_digest():
    one, other = image(2, 6, b"a" * 16), image(2, 6, b"b" * 16)
    assert all(i < 0 for i in one.cache_ids), "never a token id"
    assert one.cache_ids == image(2, 6, b"a" * 16).cache_ids
    assert all(a != b for a, b in zip(one.cache_ids, other.cache_ids, strict=True))
    s = seq(one)
    assert s.cache_token_ids[:2] == [0, 1] and s.cache_token_ids[2:8] == list(one.cache_ids)
    assert s.cache_token_ids[8:] == s.token_ids[8:] and s.token_ids[2:8] == [2, 3, 4, 5, 6, 7]


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("http://10.0.0.1/a.png", "not fetched unless the server is started with --allowed-media-domains"),
        ("file:///etc/passwd", "not read unless the server is started with --allowed-local-media-path"),
        ("ftp://10.0.0.1/a.png", "ftp: URLs are not accepted: send a data: URL"),
        ("data:image/png,rawbytes", "must be base64"),
        ("data:image/png;base64,not base64!", "does not decode"),
    ],
)
def test_by_default_only_base64_data_urls_are_taken(url, says):
    with pytest.raises(HttpError) as caught:
        DATA_ONLY.image_bytes(url, "messages[0].content[0].image_url.url")
    assert caught.value.status == 400 and says in str(caught.value)
    assert str(caught.value).startswith("messages[0].content[0].image_url.url: ")


def test_a_data_url_gives_its_bytes():
    assert DATA_ONLY.image_bytes("data:image/png;base64,aGk=", "x") == b"hi"


def test_images_to_a_text_model_are_refused_naming_what_to_do():
    request = generation_pb2.GenerateRequest(
        messages=[generation_pb2.ChatMessage(role="user", parts=[generation_pb2.ImagePart(image=b"x")])]
    )
    with pytest.raises(InvalidArgument, match="this model takes no images"):
        encode_prompt(None, None, request, 100, None)


def forward(tokens: list[int], *images: compute_pb2.VisionImage) -> compute_pb2.ForwardRequest:
    return compute_pb2.ForwardRequest(
        token_ids=tokens, cu_seqlens_q=[0, len(tokens)], num_computed=[0], images=images
    )


def vision_image(offset: int, num_tokens: int, **changes) -> compute_pb2.VisionImage:
    fields = dict(row=0, offset=offset, num_tokens=num_tokens, content_hash=b"h" * 16, tensors=[PIXELS])
    return compute_pb2.VisionImage(**{**fields, **changes})


def test_compute_places_an_images_covered_tokens_in_the_packed_row():

    tokens = [1, IMAGE_TOKEN, IMAGE_TOKEN, IMAGE_TOKEN]
    request = forward(tokens, vision_image(1, 5))
    (placed,) = compute_vision.step_images(request, torch.tensor(tokens), IMAGE_TOKEN)
    assert (placed.at, placed.first, placed.last) == (1, 0, 3), "the chunk holds its first three tokens"


@pytest.mark.parametrize(
    ("tokens", "sent", "says"),
    [
        ([1, 2, 3], vision_image(1, 2), "tokens other than the image token"),
        ([1, IMAGE_TOKEN], vision_image(5, 2), "none of row 0's new tokens"),
        ([1, IMAGE_TOKEN], vision_image(1, 1, row=3), "name no image"),
        ([1, IMAGE_TOKEN], vision_image(1, 1, content_hash=b"h"), "content_hash has 1 bytes"),
        ([1, IMAGE_TOKEN], vision_image(1, 1, tensors=[]), "send pixel_values"),
        (
            [1, IMAGE_TOKEN],
            vision_image(
                1, 1, tensors=[compute_pb2.ImageTensor(name="pixel_values", shape=[3, 9], data=b"")]
            ),
            "does not fit",
        ),
    ],
)
def test_compute_refuses_images_that_do_not_fit_the_step(tokens, sent, says):

    with pytest.raises(InvalidArgument, match=says):
        compute_vision.step_images(forward(tokens, sent), torch.tensor(tokens), IMAGE_TOKEN)


def test_a_text_model_refuses_a_step_with_images():

    with pytest.raises(InvalidArgument, match="this model takes no images"):
        compute_vision.step_images(forward([1], vision_image(0, 1)), torch.tensor([1]), None)


def test_a_vision_language_family_not_served_is_refused_before_its_weights_naming_those_served(tmp_path):
    Qwen2VLConfig().save_pretrained(tmp_path)
    with pytest.raises(architectures.UnsupportedModel) as caught:
        plan_for(str(tmp_path), Flags())
    message = str(caught.value)
    assert "model_type 'qwen2_vl' is a vision-language model" in message
    assert "vision-language types llava, llava_next, idefics3 and the text types llama" in message


def test_tokenize_refuses_image_parts():

    request = generation_pb2.GenerateRequest(
        messages=[generation_pb2.ChatMessage(role="user", parts=[generation_pb2.ImagePart(image=b"x")])]
    )
    with pytest.raises(InvalidArgument, match="image parts are taken by Generate"):
        tok.encode(None, request, 100)


def test_each_step_covers_one_image_under_a_budget_of_one_and_nobody_is_preempted():
    scheduler = make(block_size=16, num_blocks=200, max_batched_tokens=64, max_seqs=8)
    scheduler.encoder = EncoderBudget(30)
    # NOTE: a running prompt's next chunk reaches its image in a step whose budget another image took.
    seqs = [
        replace(scheduled_seq(name, length), images=(image(offset, 25),))
        for name, length, offset in (("a", 40, 14), ("b", 62, 2), ("c", 47, 16))
    ]
    for s in seqs:
        scheduler.add(s)
    waited = 0
    while not all(s.output_ids for s in seqs):
        step = scheduler.schedule()
        assert not step.preempted
        covered = [
            (s.seq_id, im.offset)
            for s in step.seqs
            for im in s.images
            if im.offset < s.chunk_end and s.num_computed < im.end
        ]
        assert len(covered) <= 1, covered
        prompts_left = [s for s in scheduler.running if s.num_computed < len(s.prompt_ids)]
        waited += len([s for s in prompts_left if s not in step.seqs])
        run(scheduler, step)
    assert waited > 0, "some prompt's image waited for a later step"


def test_the_encoder_writes_each_images_covered_rows_and_keeps_the_last_ones(tmp_path):
    model = LlavaForConditionalGeneration.from_pretrained(
        save_tiny_llava(tmp_path, local_copy("smollm2").path)
    ).eval()
    encoder = compute_vision.VisionEncoder(model, compute_vision.VisionSpec("llava", IMAGE_TOKEN), 1)
    shape = [3, IMAGE_SIZE, IMAGE_SIZE]
    pixels = [torch.randn(shape, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    tensors = [
        compute_pb2.ImageTensor(name="pixel_values", shape=shape, data=p.numpy().tobytes()) for p in pixels
    ]
    # image 0's rows 5.. at packed tokens 0.., image 1's rows ..4 at packed tokens 30..
    images = [
        compute_vision.StepImage(
            bytes([0]) * 16, {"pixel_values": tensors[0]}, IMAGE_TOKENS, 0, 5, IMAGE_TOKENS
        ),
        compute_vision.StepImage(bytes([1]) * 16, {"pixel_values": tensors[1]}, IMAGE_TOKENS, 30, 0, 4),
    ]
    embed = torch.zeros(40, model.config.text_config.hidden_size)
    with torch.inference_mode():
        assert encoder.embeddings(images, embed)[:2] == (2, 0)
        wanted = model.model.get_image_features(pixel_values=torch.stack(pixels)).pooler_output
    torch.testing.assert_close(embed[: IMAGE_TOKENS - 5], wanted[0][5:])
    torch.testing.assert_close(embed[30:34], wanted[1][:4])
    assert list(encoder.cached) == [bytes([1]) * 16], "one image kept: the last"
    short = compute_vision.StepImage(bytes([1]) * 16, {"pixel_values": tensors[1]}, IMAGE_TOKENS + 1, 0, 0, 2)
    before = embed.clone()
    with pytest.raises(InvalidArgument, match="placeholder tokens has 25 embeddings"), torch.inference_mode():
        encoder.embeddings([short], embed)
    assert torch.equal(embed, before)
