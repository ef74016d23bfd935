"""cli.runtime_dir: `pagedserve up` puts its sockets only in a directory no other user can enter or swap."""

import argparse
import os
import pathlib
import stat

import pytest

from cli import runtime_dir, up
from cli.runtime_dir import UnsafeRuntimeDir
from compute_service import standby


def test_creates_a_private_directory_and_removes_it_with_the_sockets(tmp_path):
    path = tmp_path / "run" / "pagedserve-7001"
    assert runtime_dir.prepare(path) is True
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    for service in runtime_dir.SOCKETS:
        runtime_dir.socket_path(path, service).touch()
    # compute's lock beside its socket (compute_service/standby.py)
    pathlib.Path(standby.lock_path(str(runtime_dir.socket_path(path, "compute")))).touch()
    runtime_dir.clean(path, created=True)
    assert not path.exists()


def test_keeps_an_existing_private_directory(tmp_path):
    path = tmp_path / "mine"
    path.mkdir(mode=0o700)
    (path / "notes").touch()
    assert runtime_dir.prepare(path) is False
    runtime_dir.clean(path, created=False)
    assert (path / "notes").exists(), "only the sockets are removed from a directory up did not create"


def test_refuses_a_symlink(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(UnsafeRuntimeDir, match="is a symlink"):
        runtime_dir.prepare(tmp_path / "link")


@pytest.mark.parametrize("mode", [0o750, 0o705, 0o777, 0o1777])
def test_refuses_a_directory_others_can_enter(tmp_path, mode):
    path = tmp_path / "shared"
    path.mkdir()
    path.chmod(mode)
    with pytest.raises(UnsafeRuntimeDir, match=f"has mode {mode:04o}"):
        runtime_dir.prepare(path)


def test_refuses_a_directory_another_user_owns(tmp_path):
    """Another user could have created /tmp/pagedserve-UID-PORT first, to own the sockets' directory."""
    path = tmp_path / "planted"
    path.mkdir(mode=0o700)
    os.chown(path, 65534, 65534)
    with pytest.raises(UnsafeRuntimeDir, match="owned by uid 65534"):
        runtime_dir.prepare(path)


def test_refuses_a_file(tmp_path):
    path = tmp_path / "file"
    path.touch()
    with pytest.raises(UnsafeRuntimeDir, match="not a directory"):
        runtime_dir.prepare(path)


def test_the_default_is_per_user_and_per_port(monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    assert str(runtime_dir.default_path(7001)) == "/run/user/1000/pagedserve-7001"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert runtime_dir.default_path(7001).name == f"pagedserve-{os.getuid()}-7001"


def test_up_refuses_to_start_in_an_unsafe_directory(tmp_path, capsys):
    path = tmp_path / "shared"
    path.mkdir()
    path.chmod(0o777)
    commands = argparse.ArgumentParser().add_subparsers()
    up.add_parser(commands)
    assert up.run(commands.choices["up"].parse_args(["--runtime-dir", str(path)])) == 2
    assert f"runtime dir {path} has mode 0777" in capsys.readouterr().err
    assert path.exists(), "a directory up did not create stays"
