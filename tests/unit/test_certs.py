"""`pagedserve certs`: a CA and one certificate per identity, keys 0600, idempotent unless --force."""

import ipaddress
import stat

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

import cli.main
from cli import certs
from common.transport import CA_CERT, IDENTITIES, cert_files


def load(path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def common_name(cert: x509.Certificate) -> str:
    return cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value


def sans(cert: x509.Certificate) -> set[str]:
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return {str(name.value) for name in names}


def test_writes_a_ca_and_one_certificate_per_identity(tmp_path):
    out = tmp_path / "certs"
    written = certs.generate(out, sans=["inference.internal", "10.0.0.7"])
    assert len(written) == 2 + 2 * len(IDENTITIES)
    assert mode(out) == 0o700 and mode(out / certs.CA_KEY) == 0o600
    ca = load(out / CA_CERT)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for identity in IDENTITIES:
        cert_path, key_path = cert_files(out, identity)
        assert mode(key_path) == 0o600, f"{identity}'s key is for its owner only"
        cert = load(cert_path)
        cert.verify_directly_issued_by(ca)
        assert common_name(cert) == f"pagedserve-{identity}"
        usages = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
        assert ExtendedKeyUsageOID.CLIENT_AUTH in usages
        assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    for server in certs.SERVERS:
        cert = load(cert_files(out, server)[0])
        assert sans(cert) == {server, "localhost", "127.0.0.1", "::1", "inference.internal", "10.0.0.7"}
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert ipaddress.ip_address("10.0.0.7") in names.get_values_for_type(x509.IPAddress)
    operator = load(cert_files(out, "operator")[0])
    usages = set(operator.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    assert ExtendedKeyUsageOID.SERVER_AUTH not in usages, "the operator's certificate cannot serve"


def test_is_idempotent_and_force_replaces_everything(tmp_path):
    out = tmp_path / "certs"
    certs.generate(out)
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    assert certs.generate(out) == []
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before
    cert_files(out, "compute")[1].unlink()
    assert certs.generate(out) == list(cert_files(out, "compute"))[::-1], "only the missing pair is issued"
    assert (out / CA_CERT).read_bytes() == before[CA_CERT], "with the CA kept"
    load(cert_files(out, "compute")[0]).verify_directly_issued_by(load(out / CA_CERT))
    certs.generate(out, force=True)
    after = {path.name: path.read_bytes() for path in out.iterdir()}
    assert all(after[name] != before[name] for name in before), "--force replaces every file"


def test_a_new_ca_reissues_every_certificate(tmp_path):
    out = tmp_path / "certs"
    certs.generate(out)
    (out / certs.CA_KEY).unlink()
    certs.generate(out)
    ca = load(out / CA_CERT)
    for identity in IDENTITIES:
        load(cert_files(out, identity)[0]).verify_directly_issued_by(ca)


def test_the_command_line_writes_rsa_keys_with_the_validity_asked(tmp_path, capsys):
    out = tmp_path / "certs"
    with pytest.raises(SystemExit) as done:
        cli.main.main(["certs", "--out", str(out), "--key-type", "rsa", "--days", "30"])
    assert done.value.code == 0 and f"wrote {out / CA_CERT}" in capsys.readouterr().out
    cert = load(cert_files(out, "gateway")[0])
    assert isinstance(cert.public_key(), rsa.RSAPublicKey) and cert.public_key().key_size == 2048
    assert (cert.not_valid_after_utc - cert.not_valid_before_utc).days == 30
    with pytest.raises(SystemExit):
        cli.main.main(["certs", "--out", str(out)])
    assert "kept the CA and certificates" in capsys.readouterr().out
