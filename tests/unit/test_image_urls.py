"""Image URLs besides data: (gateway.http.image_parts.MediaSources): file: URLs under the allowed directory
only (resolved, so no `..` or symlink leads out), http(s) URLs of allowed hosts only, fetched from a real
local HTTP server, bounded in bytes (an endless body is cut at the limit), redirects followed only to allowed
hosts; every refusal a 400 naming the part and the flag."""

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gateway.http.errors import HttpError
from gateway.http.image_parts import MediaSources

WHERE = "messages[0].content[1].image_url.url"
IMAGE = b"\x89PNG pretend image bytes"
LIMIT = 1000
# What the endless body's handler sends at most, should a fetch never stop reading.
ENDLESS_CAP = 64 * 2**20


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        port = self.server.server_address[1]
        routes = {
            "/image.png": (200, {"Content-Length": str(len(IMAGE))}, IMAGE),
            "/declared-big": (200, {"Content-Length": str(LIMIT + 1)}, b"x" * (LIMIT + 1)),
            "/missing": (404, {"Content-Length": "0"}, b""),
            "/redirect-in": (302, {"Location": "/image.png", "Content-Length": "0"}, b""),
            "/redirect-out": (
                302,
                {"Location": f"http://localhost:{port}/image.png", "Content-Length": "0"},
                b"",
            ),
            "/redirect-file": (302, {"Location": "file:///etc/passwd", "Content-Length": "0"}, b""),
        }
        if self.path == "/endless":
            self.send_response(200)
            self.end_headers()
            sent = 0
            try:
                while sent < ENDLESS_CAP:
                    self.wfile.write(b"x" * 65536)
                    sent += 65536
            except OSError:
                pass
            return
        status, headers, body = routes[self.path]
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def origin():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def media(tmp_path):
    root = tmp_path / "media"
    root.mkdir()
    (root / "cat.png").write_bytes(IMAGE)
    (root / "big.png").write_bytes(b"x" * (LIMIT + 1))
    (tmp_path / "secret.png").write_bytes(b"outside")
    (root / "escape.png").symlink_to(tmp_path / "secret.png")
    (root / "inside.png").symlink_to(root / "cat.png")
    return MediaSources.of(root, ["127.0.0.1"], LIMIT)


def refusal(media: MediaSources, url: str) -> str:
    with pytest.raises(HttpError) as caught:
        media.image_bytes(url, WHERE)
    assert caught.value.status == 400
    message = str(caught.value)
    assert message.startswith(f"{WHERE}: "), message
    return message


def test_a_file_under_the_directory_is_read_and_a_symlink_inside_it_too(media):
    assert media.image_bytes(f"file://{media.local_path}/cat.png", WHERE) == IMAGE
    assert media.image_bytes(f"file://{media.local_path}/inside.png", WHERE) == IMAGE
    assert media.image_bytes(f"file://localhost{media.local_path}/cat.png", WHERE) == IMAGE


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("/etc/passwd", "/etc/passwd is not under --allowed-local-media-path"),
        ("{root}/../secret.png", "is not under --allowed-local-media-path"),
        ("{root}/escape.png", "escape.png is not under --allowed-local-media-path"),
        ("{root}/absent.png", "cannot be read"),
        ("{root}/big.png", "over 1000 bytes, the limit (--max-image-bytes)"),
    ],
)
def test_a_file_outside_the_directory_through_dots_or_a_symlink_is_refused(media, name, says):
    assert says in refusal(media, "file://" + name.format(root=media.local_path))


def test_a_file_url_naming_another_host_or_a_relative_path_is_refused(media):
    assert "not host example.com" in refusal(media, f"file://example.com{media.local_path}/cat.png")
    assert "names an absolute path (file:///path), not cat.png" in refusal(media, "file:cat.png")


def test_an_allowed_host_is_fetched_and_a_redirect_to_it_followed(media, origin):
    assert media.image_bytes(f"{origin}/image.png", WHERE) == IMAGE
    assert media.image_bytes(f"{origin}/redirect-in", WHERE) == IMAGE


def test_a_host_not_listed_is_refused_before_any_connection(media, origin):
    port = origin.rsplit(":", 1)[1]
    assert "host localhost is not in --allowed-media-domains" in refusal(media, f"http://localhost:{port}/x")
    nothing = MediaSources.of(None, None, LIMIT)
    says = refusal(nothing, f"{origin}/image.png")
    assert "not fetched unless the server is started with --allowed-media-domains HOST" in says


@pytest.mark.parametrize(
    ("path", "says"),
    [
        ("/redirect-out", "host localhost is not in --allowed-media-domains"),
        ("/redirect-file", "answered HTTP 302"),
        ("/declared-big", "over 1000 bytes, the limit (--max-image-bytes)"),
        ("/endless", "over 1000 bytes, the limit (--max-image-bytes)"),
        ("/missing", "answered HTTP 404"),
    ],
)
def test_a_redirect_elsewhere_an_oversize_body_or_an_error_is_refused(media, origin, path, says):
    assert says in refusal(media, origin + path)


def test_an_unreachable_allowed_host_is_refused_naming_the_part():
    with socket.socket() as unbound:
        unbound.bind(("127.0.0.1", 0))
        port = unbound.getsockname()[1]
    media = MediaSources.of(None, ["127.0.0.1"], LIMIT)
    assert "cannot be fetched" in refusal(media, f"http://127.0.0.1:{port}/image.png")
