"""How the internal plane is reached: unix sockets for the local stack, mutual TLS across hosts.

Cache and compute listen either on a unix socket (`--socket PATH`: only the socket's owner can connect, the
trust boundary is the uid), or on TCP with mTLS (`--internal-certs DIR`: every caller needs a certificate
from DIR's CA, and `common.authz` checks what each identity may call), or on plaintext TCP only when told
`--insecure`. A certificate directory holds `ca.pem` and `<identity>.pem` + `<identity>.key` per identity
(`pagedserve certs` writes one).
"""

import argparse
import os
from pathlib import Path

import grpc

from common.authz import Authorizer, Table

IDENTITIES = ("cache", "compute", "gateway", "operator")
CA_CERT = "ca.pem"
UNIX_PREFIX = "unix:"
# The kernel's sun_path holds 108 bytes, with the terminating NUL.
MAX_SOCKET_PATH = 107
LISTEN_CHOICES = (
    "--socket PATH (local stack), --internal-certs DIR (mTLS) or --insecure (a trusted network only)"
)


def cert_files(certs_dir: str | Path, identity: str) -> tuple[Path, Path]:
    """The certificate and key file of identity in certs_dir."""
    return Path(certs_dir) / f"{identity}.pem", Path(certs_dir) / f"{identity}.key"


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise SystemExit(
            f"cannot read {path}: {err.strerror}; run `pagedserve certs --out {path.parent}`"
        ) from err


def server_credentials(certs_dir: str | Path, identity: str) -> grpc.ServerCredentials:
    """Serves as identity and admits only clients with a certificate from certs_dir's CA."""
    cert, key = cert_files(certs_dir, identity)
    return grpc.ssl_server_credentials(
        [(_read(key), _read(cert))],
        root_certificates=_read(Path(certs_dir) / CA_CERT),
        require_client_auth=True,
    )


def client_credentials(certs_dir: str | Path, identity: str) -> grpc.ChannelCredentials:
    """Presents identity's certificate and trusts only servers with a certificate from certs_dir's CA."""
    cert, key = cert_files(certs_dir, identity)
    return grpc.ssl_channel_credentials(
        root_certificates=_read(Path(certs_dir) / CA_CERT),
        private_key=_read(key),
        certificate_chain=_read(cert),
    )


def add_listen(parser: argparse.ArgumentParser) -> None:
    """How cache or compute listens: one of a unix socket, mTLS on TCP, or plaintext TCP when told."""
    plane = parser.add_mutually_exclusive_group()
    plane.add_argument("--socket", metavar="PATH", help="listen on this unix socket only (no TCP port)")
    plane.add_argument(
        "--internal-certs", metavar="DIR", help="listen on TCP with mutual TLS, certificates from DIR"
    )
    plane.add_argument(
        "--insecure",
        action="store_true",
        help="listen on plaintext TCP: anyone who reaches the port may call",
    )


def add_client_certs(parser: argparse.ArgumentParser, with_identity: bool = True) -> None:
    """How a client of cache or compute connects over mTLS: its certificate directory (and identity)."""
    parser.add_argument(
        "--internal-certs",
        metavar="DIR",
        help="connect to cache and compute with mutual TLS, certificates from DIR",
    )
    if with_identity:
        parser.add_argument(
            "--identity",
            choices=IDENTITIES,
            default="operator",
            help="whose certificate, with --internal-certs",
        )


def check_listen(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses (parser.error) a plaintext TCP listener not asked for, and a socket path the kernel cannot
    hold."""
    if not (args.socket or args.internal_certs or args.insecure):
        parser.error(f"refusing plaintext TCP on {args.host}:{args.port}: give {LISTEN_CHOICES}")
    if args.socket and len(os.fsencode(os.path.abspath(args.socket))) > MAX_SOCKET_PATH:
        parser.error(f"--socket {args.socket}: longer than {MAX_SOCKET_PATH} bytes, the kernel's limit")


def listen(args: argparse.Namespace, identity: str, callers: Table, log) -> dict:
    """serve()'s keyword arguments for a service parsed with add_listen: its socket, or its TLS credentials
    and the authorizer enforcing `callers` (a unix socket or --insecure trusts every caller)."""
    if args.socket:
        return {"socket": os.path.abspath(args.socket)}
    if args.internal_certs:
        return {
            "credentials": server_credentials(args.internal_certs, identity),
            "interceptors": [Authorizer(callers, log)],
        }
    assert args.insecure, "check_listen refuses plaintext TCP not asked for"
    log.warning("insecure_listener", address=f"{args.host}:{args.port}")
    return {}


def credentials_of(args: argparse.Namespace, identity: str | None = None) -> grpc.ChannelCredentials | None:
    """The channel credentials a client parsed with add_client_certs asked for (None: plaintext)."""
    if not args.internal_certs:
        return None
    return client_credentials(args.internal_certs, identity or args.identity)
