"""OpenAI's error JSON, `{"error": {"message", "type", "param", "code"}}`, and the one mapping of the
gateway's typed errors (gRPC status codes) to HTTP statuses."""

import re
from collections.abc import Mapping

import grpc
from fastapi.responses import JSONResponse

from common.errors import PagedServeError
from common.sampling_controls import CONTROLS
from common.server import bounded_details

# gRPC status -> (HTTP status, OpenAI error type); any other status is 500 server_error.
STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ABORTED: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
}
SERVER_ERROR = (500, "server_error")
# The request fields an error message may start with (`sampling.top_p must be ...`, `prompt has ...`).
_FIELDS = {
    *CONTROLS, "prompt", "messages", "token_ids", "cache_salt", "request_id", "token", "constraint", "tools",
    "tool_choice", "resume", "sparse_attention", "inputs", "input", "dimensions", "model", "prompts",
    "chat_template_kwargs", "queries", "documents",
}  # fmt: skip
_FIELD = re.compile(r"(?:sampling\.)?([a-z_]+)")


class HttpError(Exception):
    """A refusal of the HTTP front: status, message, OpenAI type, the parameter at fault and a code."""

    def __init__(
        self, status: int, message: str, kind: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict:
        error = {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
        return {"error": error}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def invalid(message: str, param: str | None = None, code: str | None = None) -> HttpError:
    """400 invalid_request_error: the request is malformed or asks for what is not supported."""
    return HttpError(400, message, "invalid_request_error", param, code)


def from_gateway(err: PagedServeError, renames: Mapping[str, str] = {}) -> HttpError:
    """The HTTP refusal of a gateway error (the same message the gRPC status carries). `param` names the
    request field the message starts with, under its OpenAI name (`renames`: gateway field -> that name)."""
    status, kind = STATUS.get(err.code, SERVER_ERROR)
    message = bounded_details(str(err))
    field = _FIELD.match(message)
    param = field[1] if field and field[1] in _FIELDS else None
    if param == "token":
        param = "prompt"
    param = renames.get(param, param)
    return HttpError(status, message, kind, param, err.code.name.lower())


def internal(exc: BaseException) -> HttpError:
    status, kind = SERVER_ERROR
    return HttpError(status, bounded_details(f"internal error: {exc!r}"), kind, code="internal")
