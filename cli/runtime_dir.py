"""The directory holding `pagedserve up`'s unix sockets: only its owner may enter it.

The trust boundary of the local stack is the uid: any process of the same user (and root) may call cache and
compute through these sockets; no other user can, because the directory is mode 0700 and owned by us.
"""

import contextlib
import os
import stat
import tempfile
from pathlib import Path

from compute_service import standby

# The prefill compute's only with --prefill-computes 1 (docs/scaling.md).
SOCKETS = ("cache", "compute", "prefill")


class UnsafeRuntimeDir(Exception):
    """The runtime directory exists but others could reach (or swap) the sockets in it."""


def default_path(gateway_port: int) -> Path:
    """$XDG_RUNTIME_DIR/pagedserve-PORT (a per-user 0700 directory on systemd hosts), else
    $TMPDIR/pagedserve-UID-PORT."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / f"pagedserve-{gateway_port}"
    return Path(tempfile.gettempdir()) / f"pagedserve-{os.getuid()}-{gateway_port}"


def check(path: Path) -> None:
    """Raises UnsafeRuntimeDir unless path is a real directory (not a symlink) owned by this uid and closed to
    group and others."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise UnsafeRuntimeDir(f"runtime dir {path} is a symlink: remove it or give --runtime-dir")
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeRuntimeDir(f"runtime dir {path} is not a directory: remove it or give --runtime-dir")
    if info.st_uid != os.getuid():
        raise UnsafeRuntimeDir(
            f"runtime dir {path} is owned by uid {info.st_uid}, not {os.getuid()}: "
            "remove it or give --runtime-dir"
        )
    if info.st_mode & 0o077:
        raise UnsafeRuntimeDir(
            f"runtime dir {path} has mode {stat.S_IMODE(info.st_mode):04o}: others could reach the sockets; "
            f"`chmod 700 {path}` or give another --runtime-dir"
        )


def prepare(path: Path) -> bool:
    """Creates path mode 0700 (its parents as needed), or accepts it as it is when check() passes; returns
    whether it was created here."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        # NOTE: mkdir never follows a symlink at path; an existing entry of any kind is checked instead.
        os.mkdir(path, 0o700)
        created = True
    except FileExistsError:
        created = False
    check(path)
    return created


def socket_path(runtime_dir: Path, service: str) -> Path:
    assert service in SOCKETS, service
    return runtime_dir / f"{service}.sock"


def clean(runtime_dir: Path, created: bool) -> None:
    """Removes the sockets (a service killed with SIGKILL leaves its own) and each compute's lock beside its
    socket (compute_service/standby.py), and the directory if created."""
    for service in SOCKETS:
        socket_path(runtime_dir, service).unlink(missing_ok=True)
    for service in ("compute", "prefill"):
        Path(standby.lock_path(str(socket_path(runtime_dir, service)))).unlink(missing_ok=True)
    if created:
        with contextlib.suppress(OSError):
            runtime_dir.rmdir()
