"""Typed errors and their one mapping to gRPC status codes."""

import grpc


class PagedServeError(Exception):
    """Base class: a failure a caller can act on, carried to the client as a gRPC status."""

    code = grpc.StatusCode.INTERNAL


class InvalidArgument(PagedServeError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class ResourceExhausted(PagedServeError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPrecondition(PagedServeError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class NotFound(PagedServeError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(PagedServeError):
    code = grpc.StatusCode.ALREADY_EXISTS


class Unavailable(PagedServeError):
    code = grpc.StatusCode.UNAVAILABLE


class Cancelled(PagedServeError):
    code = grpc.StatusCode.CANCELLED


class Unauthenticated(PagedServeError):
    code = grpc.StatusCode.UNAUTHENTICATED


_BY_CODE = {cls.code: cls for cls in PagedServeError.__subclasses__()}


def from_rpc_error(err: grpc.RpcError) -> PagedServeError:
    """Re-raises a downstream service's status as the same typed error, so it reaches the client unchanged."""
    cls = _BY_CODE.get(err.code(), Unavailable)
    return cls(err.details())
