"""The gateway's optional TLS: its certificate and key checked at start-up, and the credentials of a local
readiness probe (`pagedserve up`)."""

from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import NameOID


class TlsError(ValueError):
    """The certificate or key cannot be served; the message names the file and what to fix."""


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as err:
        raise TlsError(f"{path}: cannot read the {what}: {err.strerror}") from err


def _leaf(cert_path: Path, pem: bytes) -> x509.Certificate:
    """The first certificate of a PEM chain."""
    try:
        return x509.load_pem_x509_certificates(pem)[0]
    except ValueError as err:
        raise TlsError(f"{cert_path}: not a PEM certificate (chain): {err}") from err


def server_credentials(cert_path: Path | None, key_path: Path | None) -> grpc.ServerCredentials | None:
    """TLS credentials from PEM files (the certificate may be followed by its chain), None for plaintext;
    TlsError unless both or neither are given, both parse, and the key is the certificate's."""
    if (cert_path is None) != (key_path is None):
        raise TlsError("--tls-cert and --tls-key go together: give both (PEM files) or neither")
    if cert_path is None:
        return None
    cert_pem, key_pem = _read(cert_path, "certificate"), _read(key_path, "private key")
    leaf = _leaf(cert_path, cert_pem)
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as err:
        raise TlsError(f"{key_path}: not an unencrypted PEM private key: {err}") from err
    pem = serialization.Encoding.PEM
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(pem, spki) != leaf.public_key().public_bytes(pem, spki):
        raise TlsError(f"{key_path} is not the private key of the certificate in {cert_path}")
    return grpc.ssl_server_credentials([(key_pem, cert_pem)])


def probe_credentials(cert_path: Path) -> tuple[grpc.ChannelCredentials, tuple[tuple[str, str], ...]]:
    """Credentials and channel options to probe a TLS gateway on this machine: its own certificate file as
    the trust root (a self-signed certificate, or a chain up to its root), the name it was issued for.
    """
    pem = _read(cert_path, "certificate")
    leaf = _leaf(cert_path, pem)
    try:
        names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        name = (names.get_values_for_type(x509.DNSName) or [None])[0]
    except x509.ExtensionNotFound:
        name = None
    if name is None:
        common = leaf.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        name = str(common[0].value) if common else "localhost"
    return grpc.ssl_channel_credentials(root_certificates=pem), (("grpc.ssl_target_name_override", name),)
