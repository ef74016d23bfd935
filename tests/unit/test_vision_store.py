"""Compute's side of the image store (compute_service/vision.py): an image encoded under a lease with a range
is written there and kept nowhere else, a hit is read from there in place (the encoder not run) giving the
same rows, a lease that does not fit the store or the image is refused before anything changes; and the
gateway's keys tell models, salts and images apart (gateway/image_leases.py), and its dashboard shows the
store's figures."""

import pytest
import torch
from transformers import LlavaForConditionalGeneration

from common.errors import InvalidArgument
from common.model_files import local_copy
from compute_service import vision as compute_vision
from gateway.http.dashboard_state import pool_json
from gateway.image_leases import store_key
from protos import cache_pb2, compute_pb2
from tests.vision_model import IMAGE_SIZE, IMAGE_TOKENS, save_tiny_llava

IMAGE_TOKEN = 9
HIDDEN = 64  # the tiny LLaVA's text hidden size
ROW_BYTES = HIDDEN * 4


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    path = save_tiny_llava(tmp_path_factory.mktemp("llava"), local_copy("smollm2").path)
    model = LlavaForConditionalGeneration.from_pretrained(path).eval()
    assert model.config.text_config.hidden_size == HIDDEN
    spec = compute_vision.VisionSpec("llava", IMAGE_TOKEN, ROW_BYTES)
    encoder = compute_vision.VisionEncoder(model, spec, 0)
    encoder.store = torch.zeros(4 * IMAGE_TOKENS * ROW_BYTES, dtype=torch.uint8)
    return encoder


def image(seed: int, **lease) -> compute_vision.StepImage:
    shape = [3, IMAGE_SIZE, IMAGE_SIZE]
    pixels = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    tensor = compute_pb2.ImageTensor(name="pixel_values", shape=shape, data=pixels.numpy().tobytes())
    return compute_vision.StepImage(
        bytes([seed]) * 16, {"pixel_values": tensor}, IMAGE_TOKENS, 0, 0, IMAGE_TOKENS, **lease
    )


def test_an_image_is_written_to_its_range_then_read_there_without_encoding(encoder):
    nbytes = IMAGE_TOKENS * ROW_BYTES
    lease = {"store_offset": nbytes, "store_nbytes": nbytes}
    first = torch.zeros(IMAGE_TOKENS, HIDDEN)
    with torch.inference_mode():
        assert encoder.embeddings([image(1, **lease)], first)[:3] == (1, 0, 0)
    stored = encoder.store[nbytes : 2 * nbytes].view(torch.float32).view(IMAGE_TOKENS, HIDDEN)
    assert torch.equal(stored, first) and first.abs().sum() > 0
    assert not encoder.cached, "an image the store holds is not kept in compute too"
    # the hit is read from the store: different pixels under the same lease give the stored rows
    again = torch.zeros(IMAGE_TOKENS, HIDDEN)
    with torch.inference_mode():
        assert encoder.embeddings([image(2, store_hit=True, **lease)], again)[:3] == (0, 1, 1)
    assert torch.equal(again, first)


@pytest.mark.parametrize(
    ("lease", "says"),
    [
        ({"store_offset": 0, "store_nbytes": 64}, "does not hold its 25 x 256 bytes"),
        (
            {"store_offset": 4 * IMAGE_TOKENS * ROW_BYTES, "store_nbytes": IMAGE_TOKENS * ROW_BYTES},
            "does not hold",
        ),
        ({"store_offset": -64, "store_nbytes": IMAGE_TOKENS * ROW_BYTES}, "does not hold"),
        ({"store_offset": 2, "store_nbytes": IMAGE_TOKENS * ROW_BYTES}, "does not hold"),
    ],
)
def test_a_lease_off_the_store_or_the_image_is_refused_before_anything_changes(encoder, lease, says):
    store, embed = encoder.store.clone(), torch.zeros(IMAGE_TOKENS, HIDDEN)
    with pytest.raises(InvalidArgument, match=says):
        encoder.embeddings([image(3, **lease)], embed)
    assert torch.equal(encoder.store, store) and not embed.any()


def test_a_lease_without_a_store_is_refused(encoder):
    store, encoder.store = encoder.store, None
    try:
        with pytest.raises(InvalidArgument, match="the attached pool has no image store"):
            encoder.embeddings([image(4, store_hit=True, store_nbytes=64)], torch.zeros(IMAGE_TOKENS, HIDDEN))
    finally:
        encoder.store = store


def test_store_keys_differ_by_model_identity_salt_and_image():
    digest = bytes(16)
    keys = {
        store_key(b"llava\0a\0float32\0auto", "", digest),
        store_key(b"llava\0a\0bfloat16\0auto", "", digest),
        store_key(b"llava\0a\0float32\0auto", "tenant", digest),
        store_key(b"llava\0a\0float32\0auto", "", bytes([1]) * 16),
        # no part can shift into the next
        store_key(b"llava\0a\0float32\0aut", "o", digest),
    }
    assert len(keys) == 5 and all(len(key) == 16 for key in keys)
    assert store_key(b"x", "", digest) == store_key(b"x", "", digest)


def test_the_dashboard_shows_the_image_store_only_where_the_pool_has_one():
    reply = cache_pb2.BlockMap(num_blocks=1, block_size=4, states=b"\x00", refcounts=b"\x00")
    assert pool_json(reply)["image_store"] is None
    reply.image_store.CopyFrom(cache_pb2.ImageStoreStats(capacity_bytes=4096, hits=3, stored_images=1))
    shown = pool_json(reply)["image_store"]
    assert (shown["hits"], shown["stored_images"], shown["capacity_bytes"], shown["misses"]) == (
        3,
        1,
        4096,
        0,
    )


def test_one_image_under_two_leases_is_written_to_both_ranges(encoder):
    """One image of two rows whose cache salts differ: two keys, two ranges, both written."""
    nbytes = IMAGE_TOKENS * ROW_BYTES
    encoder.store.zero_()
    images = [
        image(5, store_offset=0, store_nbytes=nbytes),
        image(5, store_offset=2 * nbytes, store_nbytes=nbytes),
    ]
    with torch.inference_mode():
        assert encoder.embeddings(images, torch.zeros(IMAGE_TOKENS, HIDDEN))[0] == 1
    first, second = encoder.store[:nbytes], encoder.store[2 * nbytes : 3 * nbytes]
    assert torch.equal(first, second) and first.any()
