"""The public edge's limits, declared once: each a field of `EdgeLimits` with its default, its flag and the
status code of a refusal. The gateway checks a request against them before any expensive work (tokenizing,
queueing); a refusal names the limit, the value and the flag.

Sizes are UTF-8 bytes. NOTE: a str's length in code points is a lower bound of its UTF-8 size, so a string
far too long is refused without being encoded.
"""

import argparse
from dataclasses import dataclass, field, fields

from common.errors import InvalidArgument, ResourceExhausted
from protos import generation_pb2

# With --max-prompt-bytes 0: this many bytes per token of the model's context. No tokenizer averages
# anywhere near 32 bytes a token, so a prompt that fits the context is never refused for its size, and
# tokenizing 32 x 8192 bytes (256 KiB, SmolLM2) takes a fraction of a second.
PROMPT_BYTES_PER_TOKEN = 32


def limit(default: int, help: str, capacity: bool = False):
    """A limit's field: its default, its flag's help, and whether exceeding it is a lack of capacity
    (RESOURCE_EXHAUSTED, retry later; such a limit is >= 1) rather than a malformed request
    (INVALID_ARGUMENT; >= 0)."""
    return field(default=default, metadata={"help": help, "capacity": capacity})


@dataclass(frozen=True)
class EdgeLimits:
    max_request_bytes: int = limit(
        8 * 2**20, "bytes of one request message; gRPC refuses a larger one before reading it", capacity=True
    )
    max_request_depth: int = limit(
        64, "nesting depth of an HTTP request body's arrays and objects (HTTP 400)"
    )
    max_prompt_bytes: int = limit(
        0,
        f"bytes of prompt (or all messages' roles and contents); 0: {PROMPT_BYTES_PER_TOKEN} x max_model_len",
    )
    max_messages: int = limit(256, "chat messages of one request")
    max_embed_inputs: int = limit(256, "inputs of one embeddings request")
    max_prompts: int = limit(64, "prompts of one request (a list of prompts)")
    max_stop_bytes: int = limit(256, "bytes of each stop string")
    max_stop_token_ids: int = limit(64, "entries of sampling.stop_token_ids")
    max_logit_bias: int = limit(300, "entries of sampling.logit_bias")
    max_cache_salt_bytes: int = limit(256, "bytes of cache_salt")
    max_request_id_bytes: int = limit(128, "bytes of request_id")
    max_images_per_prompt: int = limit(8, "images of one request's messages (a vision-language model)")
    max_image_bytes: int = limit(10 * 2**20, "bytes of one encoded image")
    max_image_pixels: int = limit(
        25_000_000, "pixels (width x height) of one image, read from its header before it is decoded"
    )
    max_streams_per_key: int = limit(64, "concurrent Generate streams of one API key", capacity=True)
    # NOTE: as many as --max-streams' default: no request a default gateway admits today is refused, and
    # the queue stays bounded when --max-streams is raised.
    max_waiting: int = limit(
        256, "requests waiting for their first step; more are refused at once", capacity=True
    )

    def prompt_bytes(self, max_model_len: int) -> int:
        """The prompt size limit in force for a model of that context length."""
        return self.max_prompt_bytes or PROMPT_BYTES_PER_TOKEN * max_model_len

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EdgeLimits":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _at_least(low: int, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = low - 1
    if value < low:
        raise argparse.ArgumentTypeError(f"expected a whole number >= {low}, got {text!r}")
    return value


def count(text: str) -> int:
    """A limit's flag value: a whole number >= 0."""
    return _at_least(0, text)


def positive_count(text: str) -> int:
    """A capacity limit's flag value: a whole number >= 1."""
    return _at_least(1, text)


def add_limits(parser: argparse.ArgumentParser) -> None:
    for f in fields(EdgeLimits):
        kind = positive_count if f.metadata["capacity"] else count
        parser.add_argument(flag(f.name), type=kind, default=f.default, help=f.metadata["help"])


def table() -> list[tuple[str, int, str, str]]:
    """(limit, default, flag, status code) per limit, for docs/security.md."""
    return [
        (
            f.metadata["help"],
            f.default,
            flag(f.name),
            "RESOURCE_EXHAUSTED" if f.metadata["capacity"] else "INVALID_ARGUMENT",
        )
        for f in fields(EdgeLimits)
    ]


def _size(text: str, limit: int) -> int:
    """text's UTF-8 size, or its length in code points (a lower bound) where that already exceeds limit."""
    return len(text) if len(text) > limit else len(text.encode())


def _refuse(what: str, value: str, limit: int, name: str, unit: str) -> None:
    raise InvalidArgument(f"{what} has {value} {unit}; the limit is {limit} ({flag(name)})")


def _check_size(what: str, text: str, limit: int, name: str) -> None:
    size = _size(text, limit)
    if size > limit:
        _refuse(what, f"at least {size}", limit, name, "bytes")


def _check_count(what: str, count: int, limit: int, name: str) -> None:
    if count > limit:
        _refuse(what, str(count), limit, name, "entries")


def _check_messages(request: generation_pb2.GenerateRequest, limits: EdgeLimits, prompt_bytes: int) -> None:
    _check_count("messages", len(request.messages), limits.max_messages, "max_messages")
    total = 0
    images = [part.image for m in request.messages for part in m.parts if part.WhichOneof("part") == "image"]
    _check_count("images", len(images), limits.max_images_per_prompt, "max_images_per_prompt")
    for i, image in enumerate(images):
        if len(image) > limits.max_image_bytes:
            _refuse(f"image {i}", str(len(image)), limits.max_image_bytes, "max_image_bytes", "bytes")
    for m in request.messages:
        total += _size(m.role, prompt_bytes) + _size(m.content, prompt_bytes)
        total += sum(_size(part.text, prompt_bytes) for part in m.parts)
        if total > prompt_bytes:
            _refuse(
                "messages (roles and contents)",
                f"at least {total}",
                prompt_bytes,
                "max_prompt_bytes",
                "bytes",
            )


def check_request(request: generation_pb2.GenerateRequest, limits: EdgeLimits, max_model_len: int) -> None:
    """InvalidArgument for the first field beyond its limit; cheap: no field is encoded whole beyond its
    limit and the token ids are only counted."""
    prompt_bytes = limits.prompt_bytes(max_model_len)
    _check_size("cache_salt", request.cache_salt, limits.max_cache_salt_bytes, "max_cache_salt_bytes")
    _check_size("prompt", request.prompt, prompt_bytes, "max_prompt_bytes")
    _check_messages(request, limits, prompt_bytes)
    if len(request.token_ids) >= max_model_len:
        raise InvalidArgument(
            f"prompt has {len(request.token_ids)} tokens; the model takes at most {max_model_len - 1} "
            "so that one can be generated"
        )
    sampling = request.sampling
    _check_count(
        "sampling.stop_token_ids",
        len(sampling.stop_token_ids),
        limits.max_stop_token_ids,
        "max_stop_token_ids",
    )
    _check_count("sampling.logit_bias", len(sampling.logit_bias), limits.max_logit_bias, "max_logit_bias")
    for i, stop in enumerate(sampling.stop):
        _check_size(f"sampling.stop[{i}]", stop, limits.max_stop_bytes, "max_stop_bytes")


def check_request_id(request_id: str, limits: EdgeLimits) -> None:
    """InvalidArgument if the id the caller gave (the request's field, else its x-request-id metadata) is
    too long."""
    _check_size("request_id", request_id, limits.max_request_id_bytes, "max_request_id_bytes")


def check_queue(waiting: int, limits: EdgeLimits) -> None:
    """ResourceExhausted when the waiting queue is full."""
    if waiting >= limits.max_waiting:
        raise ResourceExhausted(
            f"the gateway's queue is full: {waiting} requests wait for their first step; the limit is "
            f"{limits.max_waiting} ({flag('max_waiting')}); retry later"
        )
