"""Per-RPC authorization on the internal plane: which certificate identity may call which method.

Under mutual TLS every caller presents a certificate signed by the plane's CA; its Common Name
`pagedserve-<identity>` names it (`gateway`, `operator`, ...). Each service declares one `Table` of its RPCs;
`Authorizer` refuses any other call with PERMISSION_DENIED naming the identity and the method. Over a unix
socket or `--insecure` no interceptor is installed: the caller is local-trusted (the socket directory's mode
is the check).
"""

from collections.abc import Iterable, Mapping

import grpc
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection

CN_PREFIX = "pagedserve-"
GATEWAY = frozenset({"gateway"})
OPERATORS = frozenset({"gateway", "operator"})
# Any identity the CA vouched for.
ANYONE = frozenset({"*"})
# Health and reflection answer every valid identity (container health checks use the service's own cert).
_OPEN_SERVICES = (health.SERVICE_NAME, reflection.SERVICE_NAME)

# Full method name (/package.Service/Method) -> the identities that may call it.
Table = Mapping[str, frozenset[str]]


def table(service: str, methods: Mapping[str, frozenset[str]], rpc_names: Iterable[str]) -> Table:
    """The table for `service`'s RPCs, with health and reflection open to any identity; every RPC of the
    service (rpc_names, from its descriptor) must be declared, so a new RPC cannot go unchecked."""
    missing = set(rpc_names) ^ set(methods)
    assert not missing, f"{service}: RPCs declared and served differ: {sorted(missing)}"
    declared = {f"/{service}/{name}": callers for name, callers in methods.items()}
    return declared | {f"/{name}/": ANYONE for name in _OPEN_SERVICES}


def identity_of(auth_context: Mapping[str, list[bytes]]) -> str | None:
    """The caller's identity from its verified certificate's Common Name, None without one."""
    names = auth_context.get("x509_common_name") or ()
    if len(names) != 1:
        return None
    name = names[0].decode(errors="replace")
    return name.removeprefix(CN_PREFIX) if name.startswith(CN_PREFIX) else name


def allowed(callers: Table, method: str, identity: str | None) -> bool:
    """Whether identity may call method: declared for it, or the method's service is open to anyone."""
    if identity is None:
        return False
    service_wide = callers.get(method[: method.rfind("/") + 1], frozenset())
    return "*" in service_wide or identity in callers.get(method, frozenset())


class Authorizer(grpc.ServerInterceptor):
    """Refuses every call whose caller's identity the table does not allow, before its handler runs.

    NOTE: the identity is only known to the servicer context, so each behaviour is wrapped; installed before
    the error interceptor, its abort keeps its status code.
    """

    def __init__(self, callers: Table, log) -> None:
        self._callers = callers
        self._log = log

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        kind = next(
            k for k in ("unary_unary", "unary_stream", "stream_unary", "stream_stream") if getattr(handler, k)
        )
        inner = getattr(handler, kind)
        streams = kind.endswith("_stream")

        def check(context) -> None:
            identity = identity_of(context.auth_context())
            if not allowed(self._callers, method, identity):
                self._log.warning("rpc_denied", method=method, identity=identity)
                context.abort(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"identity {identity!r} may not call {method} "
                    f"(allowed: {', '.join(sorted(self._callers.get(method, ()))) or 'nobody'})",
                )

        def unary(request, context):
            check(context)
            return inner(request, context)

        def stream(request, context):
            check(context)
            yield from inner(request, context)

        return handler._replace(**{kind: stream if streams else unary})
