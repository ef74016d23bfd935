"""`pagedserve certs --out DIR`: a CA and one certificate + key per identity of the internal plane.

The identity is the certificate's Common Name, `pagedserve-<identity>` (cache, compute, gateway, operator).
The services' certificates serve and present (server and client auth) and name their compose service,
localhost, 127.0.0.1 and ::1 (plus every --san); the operator's is a client certificate only. Idempotent: an
existing CA, certificate or key is kept unless --force. Keys are written mode 0600, the directory 0700.
"""

import argparse
import datetime
import ipaddress
import os
from collections.abc import Iterable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from common.authz import CN_PREFIX
from common.transport import CA_CERT, IDENTITIES, cert_files

CA_KEY = "ca.key"
CA_NAME = f"{CN_PREFIX}ca"
# The identities that serve (their certificates name hosts); the operator only calls.
SERVERS = ("cache", "compute", "gateway")
LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")
# The CA outlives the certificates it signs, so that reissuing them (--force on one file) keeps it.
CA_LIFETIMES = 10
KeyType = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey


def add_parser(commands) -> None:
    p = commands.add_parser("certs")
    p.add_argument("--out", required=True, help="directory for ca.pem and <identity>.pem/.key")
    p.add_argument("--key-type", choices=("ec", "rsa"), default="ec", help="ECDSA P-256 or RSA 2048")
    p.add_argument("--days", type=int, default=365, help="validity of each certificate (the CA: 10x)")
    p.add_argument(
        "--san", action="append", default=[], help="another DNS name or IP of the services (repeatable)"
    )
    p.add_argument("--force", action="store_true", help="replace an existing CA, certificates and keys")
    p.set_defaults(run=run)


def new_key(key_type: str) -> KeyType:
    return (
        ec.generate_private_key(ec.SECP256R1()) if key_type == "ec" else rsa.generate_private_key(65537, 2048)
    )


def _names(names: Iterable[str]) -> list[x509.GeneralName]:
    result: list[x509.GeneralName] = []
    for name in dict.fromkeys(names):
        try:
            result.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            result.append(x509.DNSName(name))
    return result


def _builder(subject: str, issuer: x509.Name, public_key, days: int) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
    )


def issue_ca(key: KeyType, days: int) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_NAME)])
    usage = x509.KeyUsage(False, False, False, False, False, True, True, False, False)
    return (
        _builder(CA_NAME, name, key.public_key(), days)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(usage, critical=True)
        .sign(key, hashes.SHA256())
    )


def issue(
    identity: str, key: KeyType, ca: x509.Certificate, ca_key: KeyType, days: int, sans: list[str]
) -> x509.Certificate:
    """identity's certificate signed by ca: CN pagedserve-<identity>; a server's names its hosts."""
    serves = identity in SERVERS
    auth = [ExtendedKeyUsageOID.CLIENT_AUTH, *([ExtendedKeyUsageOID.SERVER_AUTH] if serves else [])]
    encipher = isinstance(key, rsa.RSAPrivateKey)
    usage = x509.KeyUsage(True, False, encipher, False, False, False, False, False, False)
    builder = (
        _builder(f"{CN_PREFIX}{identity}", ca.subject, key.public_key(), days)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(usage, critical=True)
        .add_extension(x509.ExtendedKeyUsage(auth), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    if serves:
        names = _names([identity, *LOCAL_NAMES, *sans])
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(ca_key, hashes.SHA256())


def _write(path: Path, data: bytes, mode: int) -> None:
    """Writes path whole (a temporary file renamed over it), created with mode: never readable by others
    in between."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
    os.replace(tmp, path)


def _pem(key: KeyType) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _load_ca(out: Path) -> tuple[x509.Certificate, KeyType] | None:
    cert, key = out / CA_CERT, out / CA_KEY
    if not (cert.exists() and key.exists()):
        return None
    return x509.load_pem_x509_certificate(cert.read_bytes()), serialization.load_pem_private_key(
        key.read_bytes(), None
    )


def generate(
    out: Path, key_type: str = "ec", days: int = 365, sans: list[str] = (), force: bool = False
) -> list[Path]:
    """Writes what out lacks (everything with force): the CA, then each identity's certificate and key;
    returns the files written."""
    assert days > 0, "a certificate must be valid for at least a day"
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    written = []
    loaded = None if force else _load_ca(out)
    if loaded is None:
        ca_key = new_key(key_type)
        ca = issue_ca(ca_key, days * CA_LIFETIMES)
        _write(out / CA_KEY, _pem(ca_key), 0o600)
        _write(out / CA_CERT, ca.public_bytes(serialization.Encoding.PEM), 0o644)
        written += [out / CA_KEY, out / CA_CERT]
        force = True
    else:
        ca, ca_key = loaded
    for identity in IDENTITIES:
        cert_path, key_path = cert_files(out, identity)
        if not force and cert_path.exists() and key_path.exists():
            continue
        key = new_key(key_type)
        cert = issue(identity, key, ca, ca_key, days, list(sans))
        _write(key_path, _pem(key), 0o600)
        _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
        written += [key_path, cert_path]
    return written


def run(args: argparse.Namespace) -> int:
    if args.days <= 0:
        print("pagedserve certs: --days must be > 0", flush=True)
        return 2
    out = Path(args.out)
    written = generate(out, args.key_type, args.days, args.san, args.force)
    for path in written:
        print(f"wrote {path}")
    if not written:
        print(f"kept the CA and certificates in {out} (--force replaces them)")
    return 0
