"""Image embeddings kept by the cache service (docs/vision.md#image-store), through `pagedserve up` serving a
tiny random-weight LLaVA-1.5 without prefix caching (so every request runs its image's step): a repeated
image is an image store hit (the cache's metrics and `pagedserve stats` say so) read by compute instead of
encoded, with transformers' greedy tokens, and still after compute is killed and `up` restarts it (the new
compute encodes nothing); another image never hits the first's entry; a store of room for three images
evicts the least recently used one, and that image is then encoded again, its tokens unchanged; bad leases
are refused, changing nothing."""

import json
import os
import signal
import subprocess
import time

import grpc
import pytest

from cli.processes import services_of
from cli.scrape import scrape
from protos import cache_pb2
from tests.helpers import PAGEDSERVE
from tests.vision_model import IMAGE_TOKENS, png, save_tiny_llava
from tests.vision_requests import chat, greedy_reference, serving

pytestmark = pytest.mark.e2e
NEW_TOKENS = 4
MODEL = "tiny-llava"
# One image's embeddings: its tokens x the text model's hidden size (64) x float32.
IMAGE_BYTES = IMAGE_TOKENS * 64 * 4
# NOTE: requests wait for a restarted compute however long its start takes on a loaded host.
FLAGS = (
    *("--dtype", "float32", "--no-prefix-cache", "--image-store-memory", str(3 * IMAGE_BYTES)),
    *("--peer-restart-grace", "300"),
)


@pytest.fixture(scope="module")
def served(tmp_path_factory, model_dir, logs):
    """(its stack, the openai client, transformers' model and processor)."""
    path = save_tiny_llava(tmp_path_factory.mktemp("image-store") / MODEL, model_dir)
    with serving(path, logs, *FLAGS) as parts:
        yield parts


def ask(api, image: bytes) -> list[int]:
    reply = api.chat.completions.create(
        model=MODEL,
        messages=chat(image),
        max_tokens=NEW_TOKENS,
        temperature=0.0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    return reply.choices[0].model_extra["token_ids"]


def store(stack) -> dict[str, float]:
    """The cache's image store metrics, by their short names (counters without _total)."""
    metrics = scrape(stack.metrics_url("cache"))
    counters = {
        name: metrics[f"pagedserve_image_store_{name}_total", ()] for name in ("hits", "misses", "evictions")
    }
    gauges = {
        name: metrics[f"pagedserve_image_store_{name}", ()] for name in ("stored_images", "stored_bytes")
    }
    return counters | gauges


def encoder(stack) -> tuple[float, float]:
    """Compute's (images encoded, images read from the store) since it started."""
    metrics = scrape(stack.metrics_url("compute"))
    return (
        metrics["pagedserve_vision_images_encoded_total", ()],
        metrics["pagedserve_vision_image_store_reads_total", ()],
    )


def restart_compute(stack) -> None:
    """SIGKILLs compute and waits until `up` has started another and the gateway serves with it."""
    old = services_of(stack.proc.pid)["compute"]
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 240
    while services_of(stack.proc.pid).get("compute", old) == old:
        assert time.monotonic() < deadline, "up did not restart compute"
        time.sleep(0.2)
    while True:
        try:
            scrape(stack.metrics_url("compute"))
            return
        except OSError:
            assert time.monotonic() < deadline, "the restarted compute did not serve its metrics"
            time.sleep(0.2)


def test_a_repeated_image_is_read_from_the_store_also_by_a_restarted_compute(served):
    stack, api, reference, processor = served
    image = png(21)
    wanted = greedy_reference(reference, processor, image, NEW_TOKENS)
    assert ask(api, image) == wanted
    first = store(stack)
    assert (first["misses"], first["hits"], first["stored_images"]) == (1, 0, 1)
    assert first["stored_bytes"] == IMAGE_BYTES
    encoded, reads = encoder(stack)
    assert ask(api, image) == wanted
    assert store(stack)["hits"] == 1
    assert encoder(stack) == (encoded, reads + 1), "the encoder did not run; compute read the store"

    restart_compute(stack)
    assert ask(api, image) == wanted
    # NOTE: at least one more hit: a step the new compute refused before the gateway attached it again
    # leased the image too
    after = store(stack)
    assert after["hits"] >= 2 and after["misses"] == 1 and after["stored_images"] == 1
    encoded, reads = encoder(stack)
    assert encoded == 0 and reads >= 1, "the restarted compute read the image from the store, encoding none"
    out = subprocess.run(
        [*PAGEDSERVE, "stats", "--json", "--cache-target", stack.cache_target],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)["image_store"]
    assert stats["hits"] == after["hits"] and stats["misses"] == 1
    assert (stats["stored_images"], stats["capacity_bytes"]) == (1, 3 * IMAGE_BYTES)


def test_another_image_never_hits_and_the_least_recently_used_is_evicted(served):
    stack, api, reference, processor = served
    images = [png(31), png(32), png(33), png(34)]
    wanted = [greedy_reference(reference, processor, image, NEW_TOKENS) for image in images]
    assert wanted[0] != wanted[1], "the two images lead the model to different tokens"
    before = store(stack)
    assert ask(api, images[0]) == wanted[0]
    after = store(stack)
    assert after["hits"] == before["hits"] and after["misses"] == before["misses"] + 1
    # the store holds three images: once full, each new one evicts the least recently used (the first test's
    # image, then 31)
    assert ask(api, images[1]) == wanted[1]
    assert ask(api, images[2]) == wanted[2]
    assert ask(api, images[3]) == wanted[3]
    full = store(stack)
    assert full["evictions"] == before["evictions"] + before["stored_images"] + 1
    assert full["stored_images"] == 3
    assert full["hits"] == before["hits"]
    # 31 is encoded again, with the same tokens; 34 is still there
    encoded, _ = encoder(stack)
    assert ask(api, images[0]) == wanted[0]
    assert encoder(stack)[0] == encoded + 1
    assert ask(api, images[3]) == wanted[3]
    assert store(stack)["hits"] == before["hits"] + 1


def test_bad_image_leases_are_refused_changing_nothing(served):
    stack = served[0]
    cache = stack.cache()
    cache.OpenSession(cache_pb2.OpenSessionRequest(session_id="image-leases", ttl_s=30), timeout=10)
    before = stack.stats().image_store
    refusals = [
        ("image-leases", [cache_pb2.ImageStoreKey(key=b"short", nbytes=64)], "has 5 bytes, not 16"),
        ("image-leases", [cache_pb2.ImageStoreKey(key=bytes(16), nbytes=0)], "nbytes must be > 0"),
        ("never-opened", [cache_pb2.ImageStoreKey(key=bytes(16), nbytes=64)], "unknown session"),
    ]
    for session_id, images, says in refusals:
        with pytest.raises(grpc.RpcError) as caught:
            cache.AcquireImages(
                cache_pb2.ImageStoreAcquireRequest(session_id=session_id, images=images), timeout=10
            )
        assert says in caught.value.details()
    release = cache_pb2.ImageStoreReleaseRequest(
        session_id="image-leases", images=[cache_pb2.ImageStoreRelease(key=bytes(16), written=True)]
    )
    with pytest.raises(grpc.RpcError) as caught:
        cache.ReleaseImages(release, timeout=10)
    assert (
        caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "holds 0 leases" in caught.value.details()
    )
    assert stack.stats().image_store == before
    cache.CloseSession(cache_pb2.CloseSessionRequest(session_id="image-leases"), timeout=10)
