"""What each served vision-language family's processor makes of one image, split into the units compute
encodes (docs/vision.md): an image of LLaVA-1.5 or LLaVA-NeXT is one unit, one run of placeholder tokens (of a
size the processor chose for it: LLaVA-NeXT's depends on its shape); an image of Idefics3 is its
tiles, each a run of the same number of placeholders between the processor's row and column tokens, each
encoded on its own, as the model encodes them."""

import numpy as np

from common.errors import InvalidArgument

# The families whose images are tiles, one unit each.
TILED = ("idefics3",)


def runs(positions: list[int]) -> list[list[int]]:
    """The maximal runs of consecutive positions."""
    out: list[list[int]] = []
    for p in positions:
        if out and out[-1][-1] == p - 1:
            out[-1].append(p)
        else:
            out.append([p])
    return out


def image_units(family: str, out, image_runs: list[list[list[int]]], processor) -> list[list[dict]]:
    """Each image's units as {tensor name: array}, one per placeholder run of `image_runs` (each image's
    runs, in order); InvalidArgument where the runs do not fit what the processor made."""
    pixels = out["pixel_values"]
    if family in TILED:
        return _tiles(pixels[0], out["pixel_attention_mask"][0], image_runs)
    for i, found in enumerate(image_runs):
        if len(found) != 1:
            raise InvalidArgument(f"image {i}'s placeholder tokens are not consecutive in the prompt")
    if family == "llava_next":
        return [
            [{"pixel_values": pixels[i][: _patches(processor, size, pixels.shape[-2:])], "image_sizes": size}]
            for i, size in enumerate(out["image_sizes"])
        ]
    return [[{"pixel_values": image}] for image in pixels]


def _tiles(pixels: np.ndarray, masks: np.ndarray, image_runs: list[list[list[int]]]) -> list[list[dict]]:
    """Each image's tiles in the processor's order (its crops row by row, then the whole image resized)."""
    if sum(len(found) for found in image_runs) != len(pixels):
        raise InvalidArgument(
            f"the prompt has {sum(map(len, image_runs))} runs of image tokens for {len(pixels)} image tiles: "
            "leave the image and tile tokens out of the text; images go in image parts"
        )
    units, tile = [], 0
    for found in image_runs:
        units.append(
            [
                {"pixel_values": pixels[t], "pixel_attention_mask": masks[t].astype("<f4")}
                for t in range(tile, tile + len(found))
            ]
        )
        tile += len(found)
    return units


def _patches(processor, size: np.ndarray, patch_shape: tuple[int, int]) -> int:
    """LLaVA-NeXT: the patches of an image of `size` (height, width): its grid of the best resolution, and
    the whole image (the rest of the processor's array pads it to the prompt's largest image)."""
    from transformers.image_processing_utils import select_best_resolution

    height, width = select_best_resolution(
        [int(s) for s in size], processor.image_processor.image_grid_pinpoints
    )
    return -(-height // int(patch_shape[0])) * -(-width // int(patch_shape[1])) + 1
