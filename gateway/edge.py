"""The public edge of the gateway, built once from its flags: TLS credentials, the API keys (who calls,
in which prefix-cache namespace), the per-key stream cap and the request limits."""

import argparse
import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import grpc
import structlog

from gateway import auth
from gateway.limits import EdgeLimits
from gateway.streams import KeySlots
from gateway.tls import TlsError, server_credentials


class EdgeConfigError(ValueError):
    """A flag of the edge cannot be served (bad certificate, key file); the message says what to fix."""


@dataclass
class Edge:
    limits: EdgeLimits
    keys: auth.ApiKeys | None = None
    credentials: grpc.ServerCredentials | None = None

    def __post_init__(self) -> None:
        self._key_slots = KeySlots(self.limits.max_streams_per_key)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> tuple["Edge", list[str]]:
        """The edge and its warnings; EdgeConfigError if the certificate, key or key file is unusable."""
        warnings = []
        try:
            credentials = server_credentials(args.tls_cert, args.tls_key)
            keys = None
            if args.api_keys is not None:
                keys, warning = auth.load(args.api_keys, args.shared_prefix_cache)
                warnings += [warning] if warning else []
        except (TlsError, auth.KeyFileError) as err:
            raise EdgeConfigError(str(err)) from err
        return cls(EdgeLimits.from_args(args), keys, credentials), warnings

    def authenticate(self, metadata: Iterable[tuple[str, str]] | None) -> auth.Tenant:
        """The tenant of the call whose metadata (gRPC metadata, or HTTP headers with lower-case names) this
        is, its key's name bound to the call's log lines; without keys, ANONYMOUS. Unauthenticated for a
        missing or unknown key."""
        if self.keys is None:
            return auth.ANONYMOUS
        tenant = self.keys.authenticate(metadata)
        structlog.contextvars.bind_contextvars(api_key=tenant.name)
        return tenant

    @contextlib.contextmanager
    def stream_slot(self, tenant: auth.Tenant) -> Iterator[None]:
        """One of the tenant's --max-streams-per-key slots while a stream runs (none needed without keys)."""
        if self.keys is None:
            yield
            return
        with self._key_slots.hold(tenant.name):
            yield
