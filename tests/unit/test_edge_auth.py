"""API keys: the key file's format and permissions, the bearer check, each key's prefix-cache namespace;
the gateway's TLS files checked at start-up."""

import hashlib
import os

import pytest

from common.errors import ResourceExhausted, Unauthenticated
from gateway import auth
from gateway.streams import KeySlots
from gateway.tls import TlsError, probe_credentials, server_credentials
from tests.certs import self_signed

ALICE, BOB = "alice-key-0123456789abcdef", "bob-key-0123456789abcdef"


def key_file(tmp_path, text: str, mode: int = 0o600):
    path = tmp_path / "keys"
    path.write_text(text)
    os.chmod(path, mode)
    return path


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


@pytest.mark.parametrize(
    ("line", "parsed"),
    [
        ("", None),
        ("   ", None),
        ("# a comment", None),
        (f"alice:{ALICE}", ("alice", ALICE)),
        (f"  team.b-2_x:{BOB}  ", ("team.b-2_x", BOB)),
        (ALICE, ("line-7", ALICE)),
        (f"svc:{ALICE}:with-colon", ("svc", f"{ALICE}:with-colon")),
    ],
)
def test_a_line_is_a_named_key_a_bare_key_or_nothing(line, parsed):
    assert auth.parse_line(line, 7) == parsed


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("alice:short", "at least 16 characters"),
        ("alice:has white space in it", "without whitespace"),
        (f"al ice:{ALICE}", "must be letters, digits"),
        (f":{ALICE}", "must be letters, digits"),
    ],
)
def test_a_bad_line_is_refused_naming_the_line(line, message):
    with pytest.raises(auth.KeyFileError, match=message) as err:
        auth.parse_line(line, 3)
    assert "line 3" in str(err.value)


def test_the_file_loads_every_key_and_keeps_only_digests(tmp_path):
    keys, warning = auth.load(key_file(tmp_path, f"# tenants\nalice:{ALICE}\n\n{BOB}\n"))
    assert warning is None
    assert keys.names == ["alice", "line-4"]
    assert ALICE not in repr(vars(keys)) and BOB not in repr(vars(keys))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("# nothing\n", "no key in the file"),
        (f"a:{ALICE}\na:{BOB}\n", "names must be unique"),
        (f"a:{ALICE}\nb:{ALICE}\n", "a key appears twice"),
        ("a:short\n", "line 1"),
    ],
)
def test_a_bad_file_is_refused(tmp_path, text, message):
    with pytest.raises(auth.KeyFileError, match=message):
        auth.load(key_file(tmp_path, text))


def test_a_file_others_can_write_is_refused_one_they_can_read_warned(tmp_path):
    with pytest.raises(auth.KeyFileError, match="others can write the key file"):
        auth.load(key_file(tmp_path, f"a:{ALICE}\n", 0o622))
    keys, warning = auth.load(key_file(tmp_path, f"a:{ALICE}\n", 0o644))
    assert keys.names == ["a"] and "others can read the key file (mode 644): chmod 600" in warning
    with pytest.raises(auth.KeyFileError, match="must be a regular file"):
        auth.load(tmp_path)
    with pytest.raises(auth.KeyFileError, match="cannot read"):
        auth.load(tmp_path / "missing")


def test_only_a_configured_bearer_key_authenticates(tmp_path):
    keys, _ = auth.load(key_file(tmp_path, f"alice:{ALICE}\nbob:{BOB}\n"))
    assert keys.authenticate(bearer(ALICE)).name == "alice"
    assert keys.authenticate((("x-request-id", "r"), *bearer(BOB))).name == "bob"
    for metadata in ((), None, (("authorization", ALICE),), (("authorization", f"Basic {ALICE}"),)):
        with pytest.raises(Unauthenticated, match="authorization: Bearer <key>"):
            keys.authenticate(metadata)
    for wrong in (ALICE + "x", ALICE[:-1], ""):
        with pytest.raises(Unauthenticated, match="unknown API key") as err:
            keys.authenticate(bearer(wrong))
        assert ALICE not in str(err.value)


def test_the_bearer_scheme_is_case_insensitive(tmp_path):
    keys, _ = auth.load(key_file(tmp_path, f"alice:{ALICE}\n"))
    for scheme in ("bearer", "BEARER", "bEaReR"):
        assert keys.authenticate((("authorization", f"{scheme} {ALICE}"),)).name == "alice", scheme
    with pytest.raises(Unauthenticated, match="authorization: Bearer <key>"):
        keys.authenticate((("authorization", f"bearers {ALICE}"),))


def test_each_key_has_its_own_stable_one_way_namespace(tmp_path):
    keys, _ = auth.load(key_file(tmp_path, f"alice:{ALICE}\nbob:{BOB}\n"))
    alice, bob = keys.authenticate(bearer(ALICE)), keys.authenticate(bearer(BOB))
    assert alice.namespace != bob.namespace
    assert alice.namespace == auth.namespace(ALICE) == auth.namespace(ALICE)
    assert len(alice.namespace) == 32 and int(alice.namespace, 16) >= 0
    # not the key, nor a plain digest of it (the cache service sees the namespace)
    assert ALICE not in alice.namespace
    assert alice.namespace not in hashlib.sha256(ALICE.encode()).hexdigest()
    assert auth.salted(alice, "s") != auth.salted(bob, "s") != auth.salted(auth.ANONYMOUS, "s") == "s"
    assert auth.salted(alice, "s") != auth.salted(alice, "t")


def test_a_shared_prefix_cache_gives_every_key_the_callers_salt(tmp_path):
    keys, _ = auth.load(key_file(tmp_path, f"alice:{ALICE}\nbob:{BOB}\n"), shared_cache=True)
    alice, bob = keys.authenticate(bearer(ALICE)), keys.authenticate(bearer(BOB))
    assert auth.salted(alice, "s") == auth.salted(bob, "s") == "s"


def test_each_key_gets_its_own_stream_slots():
    slots = KeySlots(2)
    full = r"'alice' has 2 streams open; the limit is 2 \(--max-streams-per-key\)"
    with slots.hold("alice"), slots.hold("alice"):
        with pytest.raises(ResourceExhausted, match=full), slots.hold("alice"):
            pass
        with slots.hold("bob"):
            pass
    with slots.hold("alice"), slots.hold("alice"):
        pass


def test_tls_files_are_checked_at_start_up(tmp_path):
    cert, key = self_signed(tmp_path)
    other_cert, other_key = self_signed(tmp_path, "other")
    assert server_credentials(None, None) is None
    assert server_credentials(cert, key) is not None
    for given in ((cert, None), (None, key)):
        with pytest.raises(TlsError, match="go together"):
            server_credentials(*given)
    with pytest.raises(TlsError, match="is not the private key of the certificate"):
        server_credentials(cert, other_key)
    with pytest.raises(TlsError, match="not a PEM certificate"):
        server_credentials(key, key)
    with pytest.raises(TlsError, match="not an unencrypted PEM private key"):
        server_credentials(cert, other_cert)
    with pytest.raises(TlsError, match="cannot read the certificate"):
        server_credentials(tmp_path / "missing", key)
    _, options = probe_credentials(cert)
    assert options == (("grpc.ssl_target_name_override", "localhost"),)
