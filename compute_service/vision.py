"""Vision-language models in compute: the checkpoint split into its text model (served as any decoder, on
the paged attention) and its vision encoder (tower and projector, on transformers' own attention), and the
step's images: checked, encoded in one batch per shape (those not held encoded already) and written into the
packed input embeddings at their placeholder positions (docs/vision.md)."""

import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, PretrainedConfig, PreTrainedModel

from common.errors import InvalidArgument
from compute_service import architectures
from compute_service import vision_families as families
from protos import compute_pb2

# The vision-language model types served, each verified token for token against transformers.
FAMILIES = tuple(families.FAMILIES)
# The attention the vision tower runs on: its tokens attend to each other, never to the paged cache.
ENCODER_ATTENTION = "sdpa"
HASH_BYTES = 16
MAX_IMAGE_DIMS = 4
# Encoded images kept by default (--encoder-cache-images).
CACHE_IMAGES = 64


def is_vision(config: PretrainedConfig) -> bool:
    return hasattr(config, "vision_config") and hasattr(config, "text_config")


def text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The config of the decoder compute serves: the text model's of a served vision-language family,
    `config` itself for a text model; UnsupportedModel for a vision-language family not served."""
    if not is_vision(config):
        return config
    if config.model_type not in FAMILIES:
        raise architectures.UnsupportedModel(
            f"model_type {config.model_type!r} is a vision-language model pagedserve does not serve; it "
            f"serves the vision-language types {', '.join(FAMILIES)} and the text types "
            f"{architectures.supported()} (docs/vision.md)"
        )
    return config.text_config


@dataclass(frozen=True, slots=True)
class VisionSpec:
    family: str
    image_token_id: int


@dataclass(slots=True)
class StepImage:
    """One image of a step: its embedding rows [first, last) go to packed tokens [at, at + last - first)."""

    content_hash: bytes
    # its tensors by name (compute_service.vision_families checks them against the model's family)
    tensors: dict[str, compute_pb2.ImageTensor]
    num_tokens: int
    at: int
    first: int
    last: int


def step_images(
    request: compute_pb2.ForwardRequest, token_ids: torch.Tensor, image_token_id: int | None
) -> list[StepImage]:
    """The request's images, checked against its rows' new tokens: each covers some of its row's new tokens,
    all of them the image token; InvalidArgument naming the image otherwise (or for any image where the
    model takes none)."""
    if not request.images:
        return []
    if image_token_id is None:
        raise InvalidArgument(
            "this model takes no images: send ForwardRequest.images to a vision-language model"
        )
    cu, computed = list(request.cu_seqlens_q), list(request.num_computed)
    images = []
    for i, image in enumerate(request.images):
        where = f"images[{i}]"
        if not 0 <= image.row < len(computed) or image.num_tokens < 1 or image.offset < 0:
            raise InvalidArgument(
                f"{where}: row {image.row}, offset {image.offset}, num_tokens {image.num_tokens} name "
                f"no image of the step's {len(computed)} rows"
            )
        start, new = computed[image.row], cu[image.row + 1] - cu[image.row]
        first, last = max(start, image.offset), min(start + new, image.offset + image.num_tokens)
        if first >= last:
            raise InvalidArgument(f"{where}: its tokens are none of row {image.row}'s new tokens")
        at = cu[image.row] + first - start
        if not bool((token_ids[at : at + last - first] == image_token_id).all()):
            raise InvalidArgument(
                f"{where}: its positions hold tokens other than the image token {image_token_id}"
            )
        if len(image.content_hash) != HASH_BYTES:
            raise InvalidArgument(
                f"{where}: content_hash has {len(image.content_hash)} bytes, not {HASH_BYTES}"
            )
        tensors = _tensors(image, where)
        images.append(
            StepImage(
                image.content_hash, tensors, image.num_tokens, at, first - image.offset, last - image.offset
            )
        )
    return images


def _tensors(image: compute_pb2.VisionImage, where: str) -> dict[str, compute_pb2.ImageTensor]:
    tensors = {tensor.name: tensor for tensor in image.tensors}
    if "pixel_values" not in tensors or len(tensors) != len(image.tensors):
        raise InvalidArgument(
            f"{where}: send pixel_values (and the family's other tensors) once each, got "
            f"{[tensor.name for tensor in image.tensors]}"
        )
    for name, tensor in tensors.items():
        shape = list(tensor.shape)
        if (
            not 1 <= len(shape) <= MAX_IMAGE_DIMS
            or min(shape) < 1
            or len(tensor.data) != 4 * int(np.prod(shape))
        ):
            raise InvalidArgument(
                f"{where}: {name} of shape {shape} does not fit its {len(tensor.data)} bytes of float32"
            )
    return tensors


class VisionEncoder:
    """The tower and projector of a loaded vision-language model, and the embeddings of the last
    `cache_images` images it encoded (least recently used dropped first)."""

    def __init__(self, model: PreTrainedModel, spec: VisionSpec, cache_images: int) -> None:
        self.model = model
        self.spec = spec
        self.cache_images = cache_images
        self.cached: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    @property
    def device(self) -> torch.device:
        return self.model.device

    def embeddings(self, images: list[StepImage], embed: torch.Tensor) -> tuple[int, int, float]:
        """Writes each image's rows into `embed` [T, hidden] at its packed tokens; returns the images encoded,
        those found encoded, and the encoder's seconds. InvalidArgument, before `embed` changes, for an image
        whose embeddings are not as many as its placeholder tokens."""
        start = time.perf_counter()
        for i, image in enumerate(images):
            families.check(self.spec.family, image.tensors, f"images[{i}]")
        found = {}
        for image in images:
            if image.content_hash in self.cached:
                found[image.content_hash] = self.cached[image.content_hash]
                self.cached.move_to_end(image.content_hash)
        missing = {image.content_hash: image for image in images if image.content_hash not in found}
        family = self.spec.family
        for key in {families.batch_key(family, image.tensors) for image in missing.values()}:
            batch = [image for image in missing.values() if families.batch_key(family, image.tensors) == key]
            features = families.encode(family, self.model, [image.tensors for image in batch])
            for image, rows in zip(batch, features, strict=True):
                found[image.content_hash] = rows
                self._keep(image.content_hash, rows)
        for image in images:
            if len(found[image.content_hash]) != image.num_tokens:
                raise InvalidArgument(
                    f"an image of {image.num_tokens} placeholder tokens has {len(found[image.content_hash])} "
                    "embeddings: send the placeholders the model's processor expands it to"
                )
        for image in images:
            rows = found[image.content_hash][image.first : image.last]
            embed[image.at : image.at + len(rows)] = rows.to(embed.dtype)
        encoded = len(missing)
        return encoded, len(found) - encoded, time.perf_counter() - start

    def _keep(self, content_hash: bytes, rows: torch.Tensor) -> None:
        """Keeps the image's embeddings, the least recently used dropped past `cache_images` (0: none)."""
        if self.cache_images < 1:
            return
        self.cached[content_hash] = rows
        while len(self.cached) > self.cache_images:
            self.cached.popitem(last=False)


def load(path: str, dtype: torch.dtype, attention: str, device: str) -> PreTrainedModel:
    """The text model of the vision-language checkpoint at `path` as a causal LM on `attention` (the paged
    function), its vision encoder on ENCODER_ATTENTION in its `vision` attribute; the weights are the
    checkpoint's, loaded once and shared."""
    full = AutoModelForImageTextToText.from_pretrained(
        path,
        dtype=dtype,
        attn_implementation={
            "text_config": attention,
            "vision_config": ENCODER_ATTENTION,
            "": ENCODER_ATTENTION,
        },
    )
    full = full.eval().to(device)
    with torch.device("meta"):
        text = AutoModelForCausalLM.from_config(full.config.text_config)
    text.model = getattr(full.model, families.FAMILIES[full.config.model_type].text_model)
    text.lm_head = full.lm_head
    text.generation_config = full.generation_config
    text.eval()
    spec = VisionSpec(full.config.model_type, int(full.config.image_token_id))
    text.vision = VisionEncoder(full, spec, CACHE_IMAGES)
    return text
