"""OpenAI chat `image_url` content parts: the image's bytes from a `data:` URL (docs/vision.md). Other URL
schemes are refused: a server that fetches what a client names can be pointed at its own network."""

import base64
import binascii
from typing import Literal

from pydantic import BaseModel, ConfigDict

from gateway.http.errors import invalid
from protos import generation_pb2


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ImageURL(_Body):
    url: str
    # OpenAI's hint of the resolution wanted; the model's processor decides here, so any value is accepted.
    detail: str | None = None


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: ImageURL


def image_part(part: ImagePart, where: str) -> generation_pb2.ImagePart:
    """The part's image bytes; 400 naming `where` for a URL that is not a base64 `data:` URL."""
    return generation_pb2.ImagePart(image=data_url_bytes(part.image_url.url, f"{where}.image_url.url"))


def data_url_bytes(url: str, where: str) -> bytes:
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme != "data":
        raise invalid(
            f"{where}: only data: URLs are accepted (data:image/png;base64,...), not {scheme or 'a'} URLs: "
            "send the image's bytes inline",
            where,
        )
    header, _, payload = url[len("data:") :].partition(",")
    if not header.endswith(";base64"):
        raise invalid(f"{where}: the data: URL must be base64 (data:image/png;base64,...)", where)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise invalid(f"{where}: the data: URL's base64 does not decode: {err}", where) from None
