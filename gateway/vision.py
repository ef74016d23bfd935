"""Images in chat messages (docs/vision.md): decoded and checked, rendered with the chat template, and turned
by the model's own processor (transformers' AutoProcessor) into pixel values and the prompt's placeholder
tokens, before the request is queued; the step loop only sends what this made.

Each image (each tile, for a family that encodes tiles: gateway.vision_families) is known by a digest of
its processor outputs. The prefix cache sees its placeholder positions as ids drawn from that digest
(`cache_token_ids`), so blocks covering different images never share a hash, and the same image after the
same text hits the whole prefix."""

import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.errors import InvalidArgument
from gateway import tokenizer as tok
from gateway import vision_families as families
from gateway.limits import EdgeLimits, flag
from protos import compute_pb2, generation_pb2

# The image formats decoded (Pillow's names); any other is refused before decoding.
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
HASH_BYTES = 16
# Placeholder positions reach the cache as negative ids (token ids are >= 0), 31 bits of the digest each.
CACHE_ID_BITS = 31


@dataclass(frozen=True, slots=True)
class SeqImage:
    """One image of a prompt: its placeholder tokens are prompt positions [offset, offset + num_tokens), and
    the prefix cache sees `cache_ids` there."""

    offset: int
    num_tokens: int
    content_hash: bytes
    # the processor's outputs for this image (its pixel_values, and what the family adds)
    tensors: tuple[compute_pb2.ImageTensor, ...]
    cache_ids: tuple[int, ...]

    @classmethod
    def of(
        cls, offset: int, num_tokens: int, content_hash: bytes, tensors: tuple[compute_pb2.ImageTensor, ...]
    ) -> "SeqImage":
        return cls(offset, num_tokens, content_hash, tensors, cache_ids(content_hash, num_tokens))

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens


def cache_ids(content_hash: bytes, num_tokens: int) -> tuple[int, ...]:
    """The ids the prefix cache sees at an image's positions: each from the digest and the position."""
    ids = []
    for j in range(num_tokens):
        word = hashlib.blake2b(j.to_bytes(4, "little"), key=content_hash, digest_size=4).digest()
        ids.append(-1 - (int.from_bytes(word, "little") & (2**CACHE_ID_BITS - 1)))
    return tuple(ids)


def has_images(request: generation_pb2.GenerateRequest) -> bool:
    return any(part.WhichOneof("part") == "image" for m in request.messages for part in m.parts)


def is_vision_model(path: str) -> bool:
    """Whether the model directory holds a vision-language model (its config has a vision_config)."""
    config = Path(path) / "config.json"
    return config.is_file() and "vision_config" in json.loads(config.read_text())


class ImageInputs:
    """A vision-language model's processor and image token, and the edge's image limits."""

    def __init__(self, path: str, limits: EdgeLimits) -> None:
        """NOTE: the tokenizer is loaded first (gateway.tokenizer.load), so transformers runs without torch
        here too; the processor's image transforms are its numpy ones."""
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(path)
        self.family = json.loads((Path(path) / "config.json").read_text())["model_type"]
        self.image_token_id = int(self.processor.image_token_id)
        self.limits = limits

    def encode(self, tokenizer, conversation: list[dict], images: list[bytes], **template) -> tuple:
        """The rendered conversation's token ids and its images (SeqImage, in order); InvalidArgument for an
        image that is not one or a prompt the processor cannot expand."""
        decoded = [self._decode(i, data) for i, data in enumerate(images)]
        chat_template = getattr(self.processor, "chat_template", None) or tokenizer.chat_template
        if chat_template is None:
            raise InvalidArgument(
                "this model has no chat template: images need chat messages rendered by one"
            )
        try:
            text = tokenizer.apply_chat_template(
                conversation, chat_template=chat_template, tokenize=False, **template
            )
            out = self.processor(
                text=[text],
                images=decoded,
                return_tensors="np",
                add_special_tokens=False,
                return_text_replacement_offsets=True,
            )
        except Exception as exc:  # noqa: BLE001 - a template or processor refusal is the caller's to fix
            raise InvalidArgument(f"cannot render the messages with their images: {exc}") from exc
        ids = [int(t) for t in out["input_ids"][0]]
        return ids, self._images(ids, out, self._counts(out, len(decoded)))

    def _counts(self, out, count: int) -> list[int]:
        """The placeholder tokens the processor expanded each image to (text_replacement_offsets)."""
        token, offsets = self.processor.image_token, out["text_replacement_offsets"][0]
        counts = [r["replacement"].count(token) for r in offsets if r["type"] == "image"]
        if len(counts) != count:
            raise InvalidArgument(
                f"the prompt places {len(counts)} images for {count} image parts: leave the image token "
                "out of the text; images go in image parts"
            )
        return counts

    def _images(self, ids: list[int], out, counts: list[int]) -> list[SeqImage]:
        """Each image's units (gateway.vision_families), at its placeholder runs in order."""
        positions = [p for p, t in enumerate(ids) if t == self.image_token_id]
        if len(positions) != sum(counts):
            raise InvalidArgument(
                f"the prompt has {len(positions)} image tokens for {len(counts)} images: leave the image "
                "token out of the text; images go in image parts"
            )
        starts = np.cumsum([0, *counts])
        image_runs = [families.runs(positions[a:b]) for a, b in zip(starts, starts[1:], strict=False)]
        units = families.image_units(self.family, out, image_runs, self.processor)
        images = []
        for found, tensors in zip(image_runs, units, strict=True):
            for run, unit in zip(found, tensors, strict=True):
                images.append(_seq_image(run[0], len(run), unit))
        return images

    def _decode(self, index: int, data: bytes):
        """The image's pixels as RGB; InvalidArgument naming it for a format or a size beyond the limits
        (read from its header, before decoding), or bytes that are no image."""
        from PIL import Image, UnidentifiedImageError

        where, limits = f"image {index}", self.limits
        try:
            image = Image.open(io.BytesIO(data))
        except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
            raise InvalidArgument(
                f"{where} cannot be decoded ({exc}): send PNG, JPEG, WebP, GIF or BMP"
            ) from None
        if image.format not in FORMATS:
            raise InvalidArgument(f"{where} is {image.format}: send one of {', '.join(FORMATS)}")
        width, height = image.size
        if width * height > limits.max_image_pixels:
            raise InvalidArgument(
                f"{where} is {width}x{height} pixels; the limit is {limits.max_image_pixels} pixels "
                f"({flag('max_image_pixels')})"
            )
        try:
            return image.convert("RGB")
        except (OSError, ValueError) as exc:
            raise InvalidArgument(
                f"{where} cannot be decoded ({exc}): send PNG, JPEG, WebP, GIF or BMP"
            ) from None


def _seq_image(offset: int, num_tokens: int, unit: dict) -> SeqImage:
    """One unit of an image: its tensors as float32, known by a digest of their names, shapes and values."""
    digest = hashlib.blake2b(digest_size=HASH_BYTES)
    tensors = []
    for name, array in unit.items():
        array = np.ascontiguousarray(array, dtype="<f4")
        data = array.tobytes()
        digest.update(name.encode() + b"\0" + np.asarray(array.shape, dtype="<i8").tobytes())
        digest.update(data)
        tensors.append(compute_pb2.ImageTensor(name=name, shape=array.shape, data=data))
    return SeqImage.of(offset, num_tokens, digest.digest(), tuple(tensors))


def encode_prompt(
    inputs: ImageInputs | None, tokenizer, request: generation_pb2.GenerateRequest, vocab_size: int, tools
) -> tuple[list[int], tuple[SeqImage, ...]]:
    """The token ids and images of chat messages with image parts (gateway.tokenizer.encode's checks, the
    images' own); InvalidArgument where the model takes no images."""
    if inputs is None:
        raise InvalidArgument(
            "this model takes no images (a text model): send text content, or serve a vision-language model "
            "(docs/vision.md)"
        )
    if request.prompt or request.token_ids:
        raise InvalidArgument("set exactly one of prompt, token_ids or messages, got messages and another")
    conversation, listed = tok.chat_conversation(tokenizer, request.messages, tools)
    kwargs = tok.template_kwargs(request.chat_template_kwargs)
    images = [part.image for m in request.messages for part in m.parts if part.WhichOneof("part") == "image"]
    ids, seq_images = inputs.encode(
        tokenizer, conversation, images, tools=listed, add_generation_prompt=True, **kwargs
    )
    tok.check_vocabulary(ids, vocab_size)
    return ids, tuple(seq_images)


def forward_images(seqs) -> list[compute_pb2.VisionImage]:
    """The ForwardRequest.images of a step's rows: each image some row's chunk covers."""
    return [
        compute_pb2.VisionImage(
            row=row,
            offset=image.offset,
            num_tokens=image.num_tokens,
            content_hash=image.content_hash,
            tensors=image.tensors,
        )
        for row, seq in enumerate(seqs)
        for image in seq.images
        if image.offset < seq.chunk_end and seq.num_computed < image.end
    ]


class EncoderBudget:
    """The image tokens one step may cover (--encoder-budget; 0: no limit): a chunk that would reach an image
    beyond what is left stops before it (as chunked prefill defers tokens), unless the step has no image yet,
    so that an image larger than the budget still runs. NOTE: an image counts whole in each step a chunk of
    it runs in (compute's encoder cache makes the later ones cheap); a chunk sized but not taken counts
    too, which only defers more."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.left = tokens
        self.charged = False

    def start_step(self) -> None:
        self.left, self.charged = self.tokens, False

    def fit(self, seq, n: int) -> int:
        """How many of the n tokens from seq.chunk_start on the step may take."""
        start = seq.chunk_start
        for image in seq.images:
            if image.end <= start or image.offset >= start + n or not self.tokens:
                continue
            if image.num_tokens > self.left and self.charged:
                return max(0, image.offset - start)
            self.left, self.charged = self.left - image.num_tokens, True
        return n
