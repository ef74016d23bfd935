"""LLaVA-NeXT and Idefics3 on the CPU, without services: the gateway's processor path splits each image into
the units compute encodes (one run of a size its shape decides; tiles between row and column tokens), and
compute's encoder, given those units, writes the input embeddings transformers' own model builds; an image
whose tensors are not its family's is refused before the embeddings change, and an image token typed in the
text is refused before anything is encoded."""

import io

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

from common.errors import InvalidArgument
from common.model_files import local_copy
from compute_service import vision as compute_vision
from compute_service import vision_families as compute_families
from gateway import tokenizer as tok
from gateway import vision_families as families
from gateway.limits import EdgeLimits
from gateway.vision import ImageInputs
from protos import compute_pb2
from tests.vision_families import TILE_TOKENS, save_tiny_idefics3, save_tiny_llava_next
from tests.vision_model import png

BUILDERS = {"llava_next": save_tiny_llava_next, "idefics3": save_tiny_idefics3}
IMAGES = [png(1), png(2, (20, 50))]
CONVERSATION = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]}
]


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def family(request, tmp_path_factory):
    path = BUILDERS[request.param](tmp_path_factory.mktemp(request.param), local_copy("smollm2").path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, str(path), model


def step_images(images) -> list[compute_vision.StepImage]:
    """The gateway's units as one prefill step's images (every row of each)."""
    return [
        compute_vision.StepImage(
            image.content_hash,
            {tensor.name: tensor for tensor in image.tensors},
            image.num_tokens,
            image.offset,
            0,
            image.num_tokens,
        )
        for image in images
    ]


def reference_embeddings(model, path: str) -> torch.Tensor:
    """The input embeddings transformers' model hands its text model, for the conversation and IMAGES."""
    processor = AutoProcessor.from_pretrained(path)
    prompt = processor.tokenizer.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    images = [Image.open(io.BytesIO(image)).convert("RGB") for image in IMAGES]
    inputs = processor(text=[prompt], images=images, return_tensors="pt", add_special_tokens=False)
    seen = {}
    text_model = model.model.get_decoder()
    hook = text_model.register_forward_pre_hook(
        lambda _, args, kwargs: seen.update(embeds=kwargs["inputs_embeds"]), with_kwargs=True
    )
    with torch.inference_mode():
        model(**inputs)
    hook.remove()
    return seen["embeds"][0]


def test_the_gateways_units_encode_to_transformers_input_embeddings(family):
    name, path, model = family
    inputs = ImageInputs(path, EdgeLimits())
    ids, images = inputs.encode(tok.load(path), CONVERSATION, IMAGES, add_generation_prompt=True)
    if name == "idefics3":
        # 2x2 tiles and the whole image; 2x1 tiles and the whole image (a 20x50 image)
        assert [image.num_tokens for image in images] == [TILE_TOKENS] * 8
    else:
        assert [image.num_tokens for image in images] == [135, 85], "one run each, of its shape's size"
    assert all(ids[i] == inputs.image_token_id for image in images for i in range(image.offset, image.end))
    assert len({image.content_hash for image in images}) == len(images)
    encoder = compute_vision.VisionEncoder(model, compute_vision.VisionSpec(name, inputs.image_token_id), 0)
    with torch.inference_mode():
        embed = model.model.get_input_embeddings()(torch.tensor(ids))
        assert encoder.embeddings(step_images(images), embed)[:2] == (len(images), 0)
    torch.testing.assert_close(embed, reference_embeddings(model, path))


def test_an_image_without_its_familys_tensors_is_refused_before_the_embeddings_change(family):
    name, path, model = family
    inputs = ImageInputs(path, EdgeLimits())
    conversation = [{"role": "user", "content": [{"type": "image"}]}]
    ids, images = inputs.encode(tok.load(path), conversation, IMAGES[:1], add_generation_prompt=True)
    (image, *_) = step_images(images)
    image.tensors = {"pixel_values": image.tensors["pixel_values"]}
    encoder = compute_vision.VisionEncoder(model, compute_vision.VisionSpec(name, inputs.image_token_id), 0)
    embed = torch.zeros(len(ids), model.config.text_config.hidden_size)
    other = {"llava_next": "image_sizes", "idefics3": "pixel_attention_mask"}[name]
    with pytest.raises(InvalidArgument, match=f"images\\[0\\]: send the tensors pixel_values, {other}"):
        encoder.embeddings([image], embed)
    assert not embed.any()


def test_an_image_token_typed_in_the_text_is_refused_naming_it(family):
    _, path, _ = family
    inputs = ImageInputs(path, EdgeLimits())
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "<image>"}]}]
    says = "cannot render the messages with their images: .*2 <image> tokens and 1 images"
    with pytest.raises(InvalidArgument, match=says):
        inputs.encode(tok.load(path), conversation, IMAGES[:1], add_generation_prompt=True)


def test_placeholder_positions_split_into_runs():
    assert families.runs([3, 4, 5, 9, 10, 12]) == [[3, 4, 5], [9, 10], [12]]


def test_an_image_of_one_unit_whose_tokens_are_split_is_refused():
    out = {"pixel_values": np.zeros((1, 3, 2, 2), dtype="<f4")}
    with pytest.raises(InvalidArgument, match="image 0's placeholder tokens are not consecutive"):
        families.image_units("llava", out, [[[1, 2], [5, 6]]], None)


def test_tiles_must_be_as_many_as_the_runs_of_image_tokens():
    out = {"pixel_values": np.zeros((1, 3, 3, 4, 4)), "pixel_attention_mask": np.ones((1, 3, 4, 4))}
    (first, second) = families.image_units("idefics3", out, [[[1, 2], [4, 5]], [[8, 9]]], None)
    assert len(first) == 2 and len(second) == 1
    assert sorted(second[0]) == ["pixel_attention_mask", "pixel_values"]
    with pytest.raises(InvalidArgument, match="2 runs of image tokens for 3 image tiles"):
        families.image_units("idefics3", out, [[[1, 2], [4, 5]]], None)


def tensor(name: str, *shape: int) -> compute_pb2.ImageTensor:
    return compute_pb2.ImageTensor(name=name, shape=shape, data=bytes(4 * int(np.prod(shape))))


@pytest.mark.parametrize(
    ("name", "tensors", "says"),
    [
        ("llava_next", [tensor("pixel_values", 3, 6, 6), tensor("image_sizes", 2)], "takes 4 dimensions"),
        ("llava_next", [tensor("pixel_values", 2, 3, 6, 6), tensor("image_sizes", 3)], "not \\[2\\]"),
        (
            "idefics3",
            [tensor("pixel_values", 3, 8, 8), tensor("pixel_attention_mask", 8, 4)],
            "not pixel_values' \\[8, 8\\]",
        ),
        (
            "llava",
            [tensor("pixel_values", 3, 6, 6), tensor("image_sizes", 2)],
            "send the tensors pixel_values,",
        ),
    ],
)
def test_compute_refuses_tensors_that_are_not_the_familys(name, tensors, says):
    with pytest.raises(InvalidArgument, match=says):
        compute_families.check(name, {t.name: t for t in tensors}, "images[0]")


def test_llava_next_images_of_any_patch_counts_encode_together():
    def image(patches: int) -> dict:
        return {
            "pixel_values": tensor("pixel_values", patches, 3, 6, 6),
            "image_sizes": tensor("image_sizes", 2),
        }

    assert compute_families.batch_key("llava_next", image(3)) == compute_families.batch_key(
        "llava_next", image(5)
    )
