"""OpenAI chat `image_url` content parts and Messages API image sources: the image's bytes (docs/vision.md).

A `data:` URL is always accepted. Other URLs only where the operator allows them, as vLLM does: `file:` URLs
of files under --allowed-local-media-path, `http(s):` URLs whose host is one of --allowed-media-domains; by
default neither, since a server that fetches what a client names can be pointed at its own network
(docs/security.md). A fetch has a deadline, reads at most --max-image-bytes (and stops there), uses no
proxy, and follows a redirect only to an allowed host. Fetching and decoding run outside the event loop and
the step loop: the routes translate a body with images in a worker thread."""

import base64
import binascii
import http.client
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from gateway.http.errors import invalid
from protos import generation_pb2

# Seconds one fetch may take, from connecting to its last byte.
FETCH_TIMEOUT_S = 10.0
MAX_REDIRECTS = 5
_CHUNK = 64 * 1024
_FORMS = "a data: URL (data:image/png;base64,...)"


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ImageURL(_Body):
    url: str
    # OpenAI's hint of the resolution wanted; the model's processor decides here, so any value is accepted.
    detail: str | None = None


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: ImageURL


@dataclass(frozen=True)
class MediaSources:
    """Where image URLs may point besides `data:`: files under `local_path` (resolved), hosts in `domains`."""

    local_path: Path | None = None
    domains: frozenset[str] = frozenset()
    max_bytes: int = 10 * 2**20
    timeout_s: float = FETCH_TIMEOUT_S

    @classmethod
    def of(cls, local_path: Path | None, domains, max_bytes: int) -> "MediaSources":
        root = local_path.resolve() if local_path is not None else None
        return cls(root, frozenset(host.lower() for host in domains or ()), max_bytes)

    def image_bytes(self, url: str, where: str) -> bytes:
        """The bytes the URL names; 400 naming `where` for one not allowed or not read."""
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            return data_url_bytes(url, where)
        if scheme == "file":
            return self._file(url, where)
        if scheme in ("http", "https"):
            self._check_host(url, where)
            return self._fetch(url, where)
        kind = f"{scheme}: URLs are" if scheme else "a URL without a scheme is"
        raise invalid(f"{where}: {kind} not accepted: send {self._accepted()}", where)

    def _accepted(self) -> str:
        forms = [_FORMS]
        if self.domains:
            forms.append("an http(s) URL of a host in --allowed-media-domains")
        if self.local_path is not None:
            forms.append("a file: URL under --allowed-local-media-path")
        return " or ".join(forms)

    def _file(self, url: str, where: str) -> bytes:
        if self.local_path is None:
            raise invalid(
                f"{where}: file: URLs are not read unless the server is started with "
                f"--allowed-local-media-path DIR: send {self._accepted()}",
                where,
            )
        parsed = urllib.parse.urlsplit(url)
        if parsed.netloc not in ("", "localhost"):
            raise invalid(
                f"{where}: a file: URL names a local file (file:///path), not host {parsed.netloc}", where
            )
        path = Path(urllib.request.url2pathname(parsed.path))
        if not path.is_absolute():
            raise invalid(
                f"{where}: a file: URL names an absolute path (file:///path), not {parsed.path}", where
            )
        # NOTE: resolved, so that neither `..` nor a symlink leads out of the directory.
        path = path.resolve()
        if not path.is_relative_to(self.local_path):
            raise invalid(f"{where}: {parsed.path} is not under --allowed-local-media-path", where)
        try:
            with path.open("rb") as file:
                data = file.read(self.max_bytes + 1)
        except OSError as err:
            raise invalid(f"{where}: {parsed.path} cannot be read ({err.strerror})", where) from None
        self._check_size(len(data), where)
        return data

    def _check_host(self, url: str, where: str) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme.lower() not in ("http", "https"):
            raise invalid(f"{where}: the URL redirects to a {parsed.scheme or 'relative'} URL", where)
        host = (parsed.hostname or "").lower()
        if not self.domains:
            raise invalid(
                f"{where}: http(s) URLs are not fetched unless the server is started with "
                f"--allowed-media-domains HOST: send {self._accepted()}",
                where,
            )
        if host not in self.domains:
            raise invalid(f"{where}: host {host or '(none)'} is not in --allowed-media-domains", where)

    def _fetch(self, url: str, where: str) -> bytes:
        deadline = time.monotonic() + self.timeout_s
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _Redirects(self, where))
        request = urllib.request.Request(url, headers={"User-Agent": "pagedserve"})
        try:
            with opener.open(request, timeout=self.timeout_s) as response:
                length = response.headers.get("Content-Length", "")
                if length.isdigit():
                    self._check_size(int(length), where)
                return self._read(response, deadline, where)
        except urllib.error.HTTPError as err:
            raise invalid(f"{where}: fetching the URL answered HTTP {err.code}", where) from None
        except urllib.error.URLError as err:
            raise invalid(f"{where}: the URL cannot be fetched ({err.reason})", where) from None
        except (OSError, http.client.HTTPException) as err:
            raise invalid(
                f"{where}: the URL cannot be fetched ({err or type(err).__name__})", where
            ) from None

    def _read(self, response, deadline: float, where: str) -> bytes:
        chunks, size = [], 0
        while chunk := response.read(_CHUNK):
            size += len(chunk)
            self._check_size(size, where)
            if time.monotonic() > deadline:
                raise invalid(f"{where}: fetching the URL took over {self.timeout_s:g} s", where)
            chunks.append(chunk)
        return b"".join(chunks)

    def _check_size(self, size: int, where: str) -> None:
        if size > self.max_bytes:
            raise invalid(
                f"{where}: the image is over {self.max_bytes} bytes, the limit (--max-image-bytes)", where
            )


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Follows a redirect only to an allowed host, at most MAX_REDIRECTS times."""

    max_redirections = MAX_REDIRECTS

    def __init__(self, sources: MediaSources, where: str) -> None:
        self.sources, self.where = sources, where

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        self.sources._check_host(newurl, self.where)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


DATA_ONLY = MediaSources()


def has_images(contents: Iterable[object]) -> bool:
    """Whether any chat message content (a string, None or a list of parts) holds an image part."""
    parts = (part for content in contents if isinstance(content, list) for part in content)
    return any(isinstance(part, ImagePart) for part in parts)


def image_part(part: ImagePart, where: str, media: MediaSources) -> generation_pb2.ImagePart:
    """The part's image bytes; 400 naming `where` for a URL not allowed or not read."""
    return generation_pb2.ImagePart(image=media.image_bytes(part.image_url.url, f"{where}.image_url.url"))


def data_url_bytes(url: str, where: str) -> bytes:
    header, _, payload = url[len("data:") :].partition(",")
    if not header.endswith(";base64"):
        raise invalid(f"{where}: the data: URL must be base64 (data:image/png;base64,...)", where)
    return base64_bytes(payload, where)


def base64_bytes(payload: str, where: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise invalid(f"{where}: the base64 does not decode: {err}", where) from None
