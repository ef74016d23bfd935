"""One gRPC server bootstrap for every service: error mapping, health, reflection, graceful stop."""

import contextlib
import gc
import os
import signal
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent import futures

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common import lifeline
from common.decoding import DecodingInterceptor
from common.errors import PagedServeError

REQUEST_ID_KEY = "x-request-id"
# NOTE: gRPC refuses a call whose metadata is not printable ASCII or exceeds its size limit (8 KiB).
MAX_REQUEST_IDS_CHARS = 2048
# An error message's UTF-8 bytes at most (percent-encoded in the trailers: up to 3 characters a byte).
MAX_DETAILS_BYTES = 2000
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def _abort(context: grpc.ServicerContext, exc: Exception, method: str, log) -> None:
    if isinstance(exc, PagedServeError):
        log.info("rpc_refused", method=method, code=exc.code.name, error=str(exc))
        context.set_trailing_metadata(exc.trailing_metadata())
        context.abort(exc.code, bounded_details(str(exc)))
    log.exception("rpc_failed", method=method)
    context.abort(grpc.StatusCode.INTERNAL, bounded_details(f"internal error in {method}: {exc!r}"))


def bounded_details(message: str) -> str:
    """The message cut to MAX_DETAILS_BYTES of UTF-8. NOTE: messages quote the request (ids, values); a
    100 KB id quoted whole made the trailers exceed gRPC's limit, and the caller saw RESOURCE_EXHAUSTED."""
    data = message.encode()
    if len(data) <= MAX_DETAILS_BYTES:
        return message
    kept = data[:MAX_DETAILS_BYTES].decode(errors="ignore")
    return f"{kept}... ({len(data) - len(kept.encode())} more bytes)"


def _bind_request_id(handler_call_details) -> None:
    """Starts the call with clean log context holding its x-request-id (comma-separated for a batch)."""
    structlog.contextvars.clear_contextvars()
    for key, value in handler_call_details.invocation_metadata or ():
        if key == REQUEST_ID_KEY:
            structlog.contextvars.bind_contextvars(request_id=value)


class _ErrorInterceptor(grpc.ServerInterceptor):
    """Turns typed errors into their status codes and anything else into INTERNAL, logged once.

    Every log line written while a call runs carries the caller's x-request-id as `request_id`.
    """

    def __init__(self, log) -> None:
        self._log = log

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method, log = handler_call_details.method, self._log
        if handler.unary_unary:
            inner = handler.unary_unary

            def unary(request, context):
                _bind_request_id(handler_call_details)
                log.debug("rpc", method=method)
                try:
                    return inner(request, context)
                except Exception as exc:  # noqa: BLE001 - every failure becomes a status
                    _abort(context, exc, method, log)

            return handler._replace(unary_unary=unary)
        if handler.unary_stream:
            inner_stream = handler.unary_stream

            def stream(request, context):
                _bind_request_id(handler_call_details)
                log.debug("rpc", method=method)
                try:
                    yield from inner_stream(request, context)
                except Exception as exc:  # noqa: BLE001
                    _abort(context, exc, method, log)

            return handler._replace(unary_stream=stream)
        if handler.stream_stream:
            inner_duplex = handler.stream_stream

            def duplex(requests, context):
                _bind_request_id(handler_call_details)
                log.debug("rpc", method=method)
                try:
                    yield from inner_duplex(requests, context)
                except Exception as exc:  # noqa: BLE001
                    _abort(context, exc, method, log)

            return handler._replace(stream_stream=duplex)
        return handler


class Server:
    """A started gRPC server with the health service; after `handle_signals()`, SIGINT/SIGTERM stop it and
    `wait()` returns then."""

    def __init__(
        self,
        server: grpc.Server,
        health_servicer: health.HealthServicer,
        port: int,
        socket: str | None = None,
    ) -> None:
        self.grpc_server = server
        self.health = health_servicer
        self.port = port
        self.socket = socket
        self._stopped = threading.Event()

    def set_serving(self, service: str, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        self.health.set(service, status)
        self.health.set("", status)

    def stop(self, grace: float = 2.0) -> None:
        self.health.enter_graceful_shutdown()
        self.grpc_server.stop(grace).wait()
        if self.socket is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket)
        self._stopped.set()

    def handle_signals(self, drain: Callable[[], None] | None = None) -> None:
        """From now on SIGINT/SIGTERM, and the end of the process's lifeline (common/lifeline.py: under
        `pagedserve up`), stop the server, after `drain` returned (if given); a second signal while the first
        is handled changes nothing. Call it before the server first reports SERVING: a signal before it
        kills the process unannounced (a caller told it serves could lose its request)."""
        shutdown = threading.Event()

        def stop_after_drain() -> None:
            if drain is not None:
                drain()
            self.stop()

        def handle(signum, frame):
            if not shutdown.is_set():
                shutdown.set()
                threading.Thread(target=stop_after_drain, daemon=True).start()

        signal.signal(signal.SIGTERM, handle)
        signal.signal(signal.SIGINT, handle)
        lifeline.watch(lambda: handle(signal.SIGTERM, None))

    def wait(self, on_stop: Callable[[], None] | None = None) -> None:
        """Returns once the server stopped (see `handle_signals`) and `on_stop` ran."""
        while not self._stopped.wait(0.5):
            pass
        if on_stop is not None:
            on_stop()


def serve(
    services: Iterable[tuple[Callable, object, str]],
    host: str,
    port: int,
    log,
    serving: bool = True,
    max_workers: int = 64,
    *,
    socket: str | None = None,
    credentials: grpc.ServerCredentials | None = None,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
    max_receive_bytes: int = MAX_MESSAGE_BYTES,
) -> Server:
    """Starts a server for (add_servicer_fn, servicer, full service name) triples on host:port, or only on
    the unix socket at path `socket` (mode 0600, removed on stop), with TLS when `credentials` are given.
    `interceptors` see each call before the error mapping (an abort of theirs keeps its status code); a
    request larger than max_receive_bytes is refused (RESOURCE_EXHAUSTED) unread, one that does not decode
    is INVALID_ARGUMENT."""
    services = list(services)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers),
        interceptors=[*interceptors, _ErrorInterceptor(log), DecodingInterceptor()],
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", max_receive_bytes),
        ],
    )
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [health.SERVICE_NAME, reflection.SERVICE_NAME]
    for add, servicer, name in services:
        add(servicer, server)
        names.append(name)
    reflection.enable_server_reflection(names, server)
    address = f"unix:{socket}" if socket is not None else f"{host}:{port}"
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot bind {address}: is another server using it?")
    if socket is not None:
        # NOTE: the socket is created with the umask's mode; connecting needs write permission on it.
        os.chmod(socket, 0o600)
    # NOTE: what start-up built (a model's modules and parameters, imported code) lives as long as the
    # process: frozen out of the collector's generations, so that a full collection no longer walks it on
    # the serving path (compute: the collector's walks were ~4 % of its CPU time in a throughput run).
    gc.collect()
    gc.freeze()
    server.start()
    result = Server(server, health_servicer, bound, socket)
    for _, _, name in services:
        result.set_serving(name, serving)
    log.info("listening", address=address if socket else f"{host}:{bound}", tls=credentials is not None)
    return result


def request_metadata(request_ids: Iterable[str]) -> tuple[tuple[str, str], ...]:
    """gRPC metadata naming the requests a downstream call serves, for the callee's logs. Printable ASCII
    (other characters escaped as \\xNN, \\uNNNN) and at most MAX_REQUEST_IDS_CHARS long: a client's request
    id must not make the call fail for every request it serves."""
    return ((REQUEST_ID_KEY, printable_ascii(",".join(request_ids))[:MAX_REQUEST_IDS_CHARS]),)


def printable_ascii(text: str) -> str:
    """text with every character but printable ASCII escaped (\\xNN, \\uNNNN): what a request id may carry
    into metadata, headers and logs."""
    text = text.encode("ascii", "backslashreplace").decode("ascii")
    return "".join(c if " " <= c <= "~" else f"\\x{ord(c):02x}" for c in text)


def channel(
    target: str, credentials: grpc.ChannelCredentials | None = None, options: Sequence[tuple] = ()
) -> grpc.Channel:
    """A channel to target (HOST:PORT or unix:PATH), over TLS when credentials are given; `options` are
    added to the message-size ones."""
    if credentials is not None:
        return grpc.secure_channel(target, credentials, options=[*CHANNEL_OPTIONS, *options])
    return grpc.insecure_channel(target, options=[*CHANNEL_OPTIONS, *options])
