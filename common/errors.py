"""Typed errors and their one mapping to gRPC status codes."""

import grpc


class PagedServeError(Exception):
    """Base class: a failure a caller can act on, carried to the client as a gRPC status."""

    code = grpc.StatusCode.INTERNAL

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        """What the status carries besides its code and message, for a caller's code to read."""
        return ()


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


class Aborted(PagedServeError):
    code = grpc.StatusCode.ABORTED


class Unauthenticated(PagedServeError):
    code = grpc.StatusCode.UNAUTHENTICATED


class Unimplemented(PagedServeError):
    code = grpc.StatusCode.UNIMPLEMENTED


# Trailing metadata of a refused step naming the rows (sequences, in request order) that caused it.
BAD_ROWS_KEY = "pagedserve-bad-rows"


class RowsRefused(InvalidArgument):
    """A batched request refused because of some of its rows only; the others are fine. The status carries
    the rows under BAD_ROWS_KEY ("2,5"), so the caller can fail those alone and send the rest again."""

    def __init__(self, message: str, rows) -> None:
        super().__init__(message)
        self.rows = tuple(sorted({int(row) for row in rows}))
        assert self.rows and self.rows[0] >= 0, self.rows

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return ((BAD_ROWS_KEY, ",".join(map(str, self.rows))),)


_BY_CODE = {cls.code: cls for cls in (PagedServeError, *PagedServeError.__subclasses__())}


def from_rpc_error(err: grpc.RpcError) -> PagedServeError:
    """Re-raises a downstream service's status as the same typed error, so it reaches the client unchanged."""
    cls = _BY_CODE.get(err.code(), Unavailable)
    return cls(err.details())


def refused_rows(err: grpc.RpcError) -> tuple[int, ...] | None:
    """The rows an INVALID_ARGUMENT status names under BAD_ROWS_KEY (see RowsRefused); None if it names none,
    or names them in a form this code does not read."""
    if err.code() != grpc.StatusCode.INVALID_ARGUMENT:
        return None
    values = [value for key, value in err.trailing_metadata() or () if key == BAD_ROWS_KEY]
    if len(values) != 1 or not all(part.isascii() and part.isdigit() for part in values[0].split(",")):
        return None
    return tuple(sorted({int(part) for part in values[0].split(",")}))
