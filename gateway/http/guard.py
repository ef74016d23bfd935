"""What every generating route shares: the request id (the caller's X-Request-Id, escaped, or none), and
every failure turned into the route's error response: a refusal (HttpError), a gateway error under its
HTTP status, a client gone (499), anything else (500, logged)."""

from collections.abc import Awaitable, Callable, Mapping

import structlog
from fastapi import Request
from fastapi.responses import Response

from common.errors import PagedServeError
from common.server import printable_ascii
from gateway.http.bridge import ClientGone
from gateway.http.errors import HttpError, from_gateway, internal

log = structlog.get_logger()
REQUEST_ID_HEADER = "x-request-id"
# A response nobody reads: the client is gone (nginx's "client closed request").
CLIENT_GONE = 499


async def guarded(
    request: Request,
    run: Callable[[str], Awaitable[Response]],
    renames: Mapping[str, str] = {},
    refuse: Callable[[HttpError], Response] = HttpError.response,
) -> Response:
    """`run(request_id)`'s response, or the error response `refuse` makes of its failure (gateway fields in
    messages named as `renames` says)."""
    structlog.contextvars.clear_contextvars()
    # NOTE: a caller's id takes --max-request-id-bytes; without one the gateway makes one (in the replies).
    # Control and non-ASCII characters are escaped first, so the id the replies' header and body carry is one.
    request_id = printable_ascii(request.headers.get(REQUEST_ID_HEADER, ""))
    if request_id:
        structlog.contextvars.bind_contextvars(request_id=request_id)
    try:
        return await run(request_id)
    except HttpError as err:
        log.info("http_refused", status=err.status, error=err.message)
        return refuse(err)
    except PagedServeError as err:
        refusal = from_gateway(err, renames)
        log.info("http_refused", status=refusal.status, code=err.code.name, error=refusal.message)
        return refuse(refusal)
    except ClientGone:
        log.info("client_gone")
        return Response(status_code=CLIENT_GONE)
    except Exception as exc:  # noqa: BLE001 - every failure gets the API's error JSON
        log.exception("http_failed")
        return refuse(internal(exc))
