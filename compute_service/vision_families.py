"""How each served vision-language family encodes a batch of a step's images (compute_service.vision): the
tensors an image carries, the images one encoder call may take together, and the call, transformers' own
(`get_image_features`: vision tower and projector or connector), so that the embeddings are the model's."""

from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedModel

from common.errors import InvalidArgument
from protos import compute_pb2


@dataclass(frozen=True, slots=True)
class Family:
    # the tensors each image sends (VisionImage.tensors), by name
    tensors: tuple[str, ...]
    # the attribute of the checkpoint's model that holds its text model
    text_model: str


FAMILIES = {
    # one image: pixel_values [3, H, W]
    "llava": Family(("pixel_values",), "language_model"),
    # one image: its patches pixel_values [P, 3, H, W] and image_sizes [2] (height, width before processing)
    "llava_next": Family(("pixel_values", "image_sizes"), "language_model"),
    # one tile of an image: pixel_values [3, H, W], pixel_attention_mask [H, W] (1: a pixel of the image)
    "idefics3": Family(("pixel_values", "pixel_attention_mask"), "text_model"),
}


def check(family: str, tensors: dict[str, compute_pb2.ImageTensor], where: str) -> None:
    """InvalidArgument unless the image sends its family's tensors, of shapes that fit each other."""
    names = FAMILIES[family].tensors
    if sorted(tensors) != sorted(names):
        raise InvalidArgument(f"{where}: send the tensors {', '.join(names)}, got {sorted(tensors)}")
    pixels = list(tensors["pixel_values"].shape)
    wanted = {"llava": 3, "llava_next": 4}.get(family, 3)
    if len(pixels) != wanted:
        raise InvalidArgument(f"{where}: pixel_values has shape {pixels}; {family} takes {wanted} dimensions")
    if family == "llava_next" and list(tensors["image_sizes"].shape) != [2]:
        raise InvalidArgument(f"{where}: image_sizes has shape {list(tensors['image_sizes'].shape)}, not [2]")
    if family == "idefics3" and list(tensors["pixel_attention_mask"].shape) != pixels[1:]:
        raise InvalidArgument(
            f"{where}: pixel_attention_mask has shape {list(tensors['pixel_attention_mask'].shape)}, "
            f"not pixel_values' {pixels[1:]}"
        )


def batch_key(family: str, tensors: dict[str, compute_pb2.ImageTensor]) -> tuple:
    """Images of one key are encoded in one call (LLaVA-NeXT's of any number of patches)."""
    shape = tuple(tensors["pixel_values"].shape)
    return shape[1:] if family == "llava_next" else shape


def encode(family: str, model: PreTrainedModel, batch: list[dict[str, compute_pb2.ImageTensor]]) -> list:
    """Each image's embeddings [its placeholder tokens, hidden], in order."""
    device, dtype = model.device, model.dtype

    def stacked(name: str) -> torch.Tensor:
        return torch.stack([tensor(image[name]) for image in batch]).to(device)

    if family == "llava_next":
        pixels = torch.cat([tensor(image["pixel_values"]) for image in batch]).to(device, dtype)
        sizes = stacked("image_sizes").to(torch.int64)
        return list(model.model.get_image_features(pixel_values=pixels, image_sizes=sizes).pooler_output)
    if family == "idefics3":
        # each tile a batch row of its own: [tiles, 1, 3, H, W]
        pixels, masks = stacked("pixel_values")[:, None].to(dtype), stacked("pixel_attention_mask")[:, None]
        out = model.model.get_image_features(pixel_values=pixels, pixel_attention_mask=masks.bool())
        return list(out.pooler_output)
    return list(model.model.get_image_features(pixel_values=stacked("pixel_values").to(dtype)).pooler_output)


def tensor(message: compute_pb2.ImageTensor) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(message.data, dtype="<f4").reshape(tuple(message.shape)).copy())
