"""API keys for the public API: the key file, the bearer token check, each key's prefix-cache namespace.

The key file holds one key per line, `NAME:KEY` or a bare `KEY` (named `line-N` after its line); blank lines
and lines starting with `#` are skipped. Names are letters, digits, `.`, `_`, `-`; keys are at least
MIN_KEY_CHARS characters without whitespace (a key containing `:` needs a name). The gateway keeps only each
key's SHA-256 and compares digests with hmac.compare_digest; logs carry the key's name, never the key.
"""

import hashlib
import hmac
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from common.errors import Unauthenticated

MIN_KEY_CHARS = 16
AUTHORIZATION = "authorization"
BEARER = "Bearer "
_NAME = re.compile(r"[A-Za-z0-9._-]+")
HOW = f"send the metadata '{AUTHORIZATION}: {BEARER}<key>' (SDK: api_key=, CLI: --api-key)"
# NOTE: domain separation: the namespace of a key is not its stored digest (which the cache never sees).
_NAMESPACE_PERSON = b"ps-cache-ns"


class KeyFileError(ValueError):
    """The key file cannot be used; the message names the file, the line and what to fix."""


@dataclass(frozen=True)
class Tenant:
    """Who a request comes from: the key's name (for logs and limits) and its prefix-cache namespace."""

    name: str
    namespace: str


# Requests of a gateway without keys: one tenant, the shared namespace.
ANONYMOUS = Tenant("anonymous", "")


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def namespace(key: str) -> str:
    """The key's prefix-cache namespace: stable across restarts, distinct per key, and a one-way function
    of the key (BLAKE2b personalised for this use, so it equals no other digest of the key)."""
    return hashlib.blake2b(key.encode(), digest_size=16, person=_NAMESPACE_PERSON).hexdigest()


def salted(tenant: Tenant, cache_salt: str) -> str:
    """The cache_salt the cache service sees: the tenant's namespace folded in, so that only requests of
    one key (and of equal cache_salt) share prefix blocks. NOTE: the namespace has a fixed length, so
    (namespace, salt) pairs map to distinct strings."""
    return f"{tenant.namespace}:{cache_salt}" if tenant.namespace else cache_salt


def parse_line(line: str, number: int) -> tuple[str, str] | None:
    """(name, key) of one line of the key file, None for a blank or comment line; KeyFileError if bad."""
    text = line.strip()
    if not text or text.startswith("#"):
        return None
    name, sep, key = text.partition(":")
    if not sep:
        name, key = f"line-{number}", text
    if not _NAME.fullmatch(name):
        raise KeyFileError(f"line {number}: the name {name!r} must be letters, digits, '.', '_' or '-'")
    if len(key) < MIN_KEY_CHARS or any(c.isspace() for c in key):
        raise KeyFileError(
            f"line {number} ({name}): a key must be at least {MIN_KEY_CHARS} characters without whitespace"
        )
    return name, key


class ApiKeys:
    """The keys of a key file, by digest; `authenticate` maps request metadata to its Tenant."""

    def __init__(self, entries: list[tuple[str, str]], shared_cache: bool = False) -> None:
        names = [name for name, _ in entries]
        if len(set(names)) != len(names):
            raise KeyFileError(f"names must be unique: {sorted(n for n in names if names.count(n) > 1)}")
        if len({key for _, key in entries}) != len(entries):
            raise KeyFileError("a key appears twice")
        if not entries:
            raise KeyFileError("no key in the file")
        self._tenants = [
            (digest(key), Tenant(name, "" if shared_cache else namespace(key))) for name, key in entries
        ]

    @property
    def names(self) -> list[str]:
        return [tenant.name for _, tenant in self._tenants]

    def authenticate(self, metadata) -> Tenant:
        """The tenant whose key the call's `authorization: Bearer <key>` metadata carries; Unauthenticated
        when it is missing or unknown. Every stored digest is compared, in constant time each."""
        token = next((value for key, value in metadata or () if key == AUTHORIZATION), None)
        # NOTE: the scheme is case-insensitive (RFC 6750, RFC 9110): "bearer KEY" is as good as "Bearer KEY".
        scheme, _, credentials = (token or "").strip().partition(" ")
        if scheme.lower() != BEARER.strip().lower():
            raise Unauthenticated(f"this gateway requires an API key: {HOW}")
        presented, found = digest(credentials.strip()), None
        for stored, tenant in self._tenants:
            if hmac.compare_digest(stored, presented):
                found = tenant
        if found is None:
            raise Unauthenticated(f"unknown API key: {HOW} with a key from the gateway's --api-keys file")
        return found


def load(path: Path, shared_cache: bool = False) -> tuple[ApiKeys, str | None]:
    """The key file's keys, and a warning if others can read it; KeyFileError if others can write it, or
    it is not a regular file, or a line is bad."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise KeyFileError(f"{path}: the key file must be a regular file")
        text = path.read_text()
    except OSError as err:
        raise KeyFileError(f"{path}: cannot read the key file: {err.strerror}") from err
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise KeyFileError(
            f"{path}: others can write the key file (mode {info.st_mode & 0o777:o}): chmod 600"
        )
    warning = None
    if info.st_mode & (stat.S_IRGRP | stat.S_IROTH):
        warning = f"{path}: others can read the key file (mode {info.st_mode & 0o777:o}): chmod 600"
    try:
        entries = [e for n, line in enumerate(text.splitlines(), 1) if (e := parse_line(line, n))]
        return ApiKeys(entries, shared_cache), warning
    except KeyFileError as err:
        raise KeyFileError(f"{path}: {err}") from None
