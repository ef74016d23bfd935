"""Every HTTP request body, on every route, read and parsed once before any route runs: larger than
--max-request-bytes is 413 (unread past the limit), nested deeper than --max-request-depth or not JSON is
400, each in OpenAI's error JSON. A route reads the parsed value with `request_json`; the body stays readable
(`request.body()`) for a route that wants its bytes."""

import json

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.json_depth import json_depth
from gateway.http.errors import HttpError, invalid

# Where the parsed body waits for the route (the ASGI scope's state: request.state).
_PARSED = "json_body"
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


class BodyLimits:
    """The ASGI middleware that reads, bounds and parses the bodies (create_app installs it)."""

    def __init__(self, app: ASGIApp, max_bytes: int, max_depth: int) -> None:
        self.app, self.max_bytes, self.max_depth = app, max_bytes, max_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        try:
            data = await self._read(scope, receive)
            if data is None:
                return  # the client left before its body arrived: nobody to answer
            if data:
                scope.setdefault("state", {})[_PARSED] = self.parse(data)
        except HttpError as err:
            await err.response()(scope, receive, send)
            return
        await self.app(scope, _replay(data, receive), send)

    async def _read(self, scope: Scope, receive: Receive) -> bytes | None:
        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            raise too_large(int(length), self.max_bytes)
        data = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            data += message.get("body", b"")
            if len(data) > self.max_bytes:
                raise too_large(len(data), self.max_bytes)
            if not message.get("more_body", False):
                break
        return bytes(data)

    def parse(self, data: bytes) -> object:
        """The body's JSON value; HttpError 400 when it nests deeper than the limit or is not JSON."""
        depth = json_depth(data)
        if depth > self.max_depth:
            raise invalid(
                f"the request body nests arrays and objects {depth} levels deep; the limit is "
                f"{self.max_depth} (--max-request-depth)",
                code="request_too_deep",
            )
        try:
            return json.loads(data)
        except (ValueError, RecursionError) as err:
            raise invalid(f"the request body is not valid JSON: {err}") from None


def request_json(request: Request) -> object:
    """The request's body as BodyLimits parsed it; 400 when it had none."""
    state = request.scope.get("state", {})
    if _PARSED not in state:
        raise invalid("the request body is empty: send a JSON object")
    return state[_PARSED]


def too_large(size: int, limit: int) -> HttpError:
    return HttpError(
        413,
        f"the request body has at least {size} bytes; the limit is {limit} (--max-request-bytes)",
        "invalid_request_error",
        code="request_too_large",
    )


def _replay(data: bytes, receive: Receive) -> Receive:
    """`receive` that hands the route the body already read, then passes on (a disconnect, say)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": data, "more_body": False}
        return await receive()

    return replayed
