"""Requests that do not decode (invalid UTF-8 in a string field, bytes that are not the message) get
INVALID_ARGUMENT with the decoder's reason, on every service, instead of gRPC's INTERNAL
"Exception deserializing request!".

NOTE: gRPC swallows an exception raised by a request deserializer and aborts with INTERNAL itself, so the
deserializer returns an `Undecodable` in place of the request and the handler raises InvalidArgument for it,
which the error interceptor maps like any refusal.
"""

from collections.abc import Callable
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from common.errors import InvalidArgument


@dataclass(frozen=True)
class Undecodable:
    """Stands for a request whose bytes did not decode; `reason` is the decoder's message."""

    reason: str


def tolerant(deserialize: Callable[[bytes], object]) -> Callable[[bytes], object]:
    """deserialize, returning an Undecodable where it raises DecodeError."""

    def decode(data: bytes) -> object:
        try:
            return deserialize(data)
        except DecodeError as err:
            return Undecodable(str(err))

    return decode


def _refuse(request: object, method: str) -> None:
    if isinstance(request, Undecodable):
        raise InvalidArgument(
            f"cannot decode the {method} request: {request.reason} (string fields must be valid UTF-8)"
        )


class DecodingInterceptor(grpc.ServerInterceptor):
    """Refuses undecodable requests of every method with INVALID_ARGUMENT. Place it after the error
    interceptor (it runs inside it, so its InvalidArgument becomes the status)."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        if handler.unary_unary:
            inner = handler.unary_unary

            def unary(request, context):
                _refuse(request, method)
                return inner(request, context)

            return handler._replace(
                request_deserializer=tolerant(handler.request_deserializer), unary_unary=unary
            )
        if handler.unary_stream:
            inner_stream = handler.unary_stream

            def stream(request, context):
                _refuse(request, method)
                yield from inner_stream(request, context)

            return handler._replace(
                request_deserializer=tolerant(handler.request_deserializer), unary_stream=stream
            )
        if handler.stream_stream:
            inner_duplex = handler.stream_stream

            def checked(requests):
                for request in requests:
                    _refuse(request, method)
                    yield request

            def duplex(requests, context):
                yield from inner_duplex(checked(requests), context)

            return handler._replace(
                request_deserializer=tolerant(handler.request_deserializer), stream_stream=duplex
            )
        return handler
