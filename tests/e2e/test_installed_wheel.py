"""The package as a user installs it: the wheel built from this tree carries every file the native kernels
are compiled from; installed (not editable) into a fresh virtual environment, its kernels compile from the
installed files alone, and its compute service plans the native paths, says so at start-up and serves a
step.

NOTE: the fresh environment takes the project's dependencies (torch, transformers, ...) from the project's
own environment through a path file, so nothing is downloaded; the package itself, `pagedserve` and its
console script, comes from the wheel only, and the kernels are built into a directory of their own (a
build keyed by the same sources elsewhere is not reused)."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import torch

from cli.launch import spawn, stop, wait_healthy
from common import shared_pool
from common.server import channel
from compute_service import kernels
from protos import compute_pb2, compute_pb2_grpc
from tests.forward import forward_request
from tests.helpers import ROOT, socket_dir
from tests.tiny_model import save_tiny_llama

# A compile of the kernels takes minutes on a loaded 2-vCPU host.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]

# What `pip wheel` needs of the tree: the build configuration and the packages (tests and docs stay out).
TREE = (
    "pyproject.toml",
    "README.md",
    "protos",
    "common",
    "cache_service",
    "compute_service",
    "gateway",
    "sdk",
    "cli",
)
BLOCK_SIZE, NUM_BLOCKS = 4, 16


def run(argv: list[str], cwd: Path, env: dict | None = None, timeout: float = 600) -> str:
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (
        f"{' '.join(map(str, argv))} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    )
    return done.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel `pip wheel` builds from a copy of this tree (so no build/ is left in the checkout)."""
    source, dist = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("dist")
    for name in TREE:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(path, source / name)
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist)]
    run([*pip, str(source)], cwd=source)
    (built,) = dist.glob("pagedserve-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh virtual environment with the wheel installed; its dependencies are the project's."""
    root = tmp_path_factory.mktemp("venv")
    run([sys.executable, "-m", "venv", "--without-pip", str(root)], cwd=root)
    python = root / "bin" / "python"
    purelib = Path(
        run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], root).strip()
    )
    (purelib / "project-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
        cwd=root,
    )
    return root


def test_the_wheel_carries_every_file_the_kernels_are_built_from(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    needed = {f"compute_service/kernels/{path.name}" for path in (*kernels.SOURCES, *kernels.HEADERS)}
    assert needed <= names, f"the wheel lacks {sorted(needed - names)}"


@pytest.fixture(scope="module")
def installed(venv, tmp_path_factory) -> tuple[dict, str, str]:
    """The environment to run the installed package in (outside the checkout, no PYTHONPATH, its kernels
    built in a fresh directory), where it imports compute_service from, and what building the kernels from
    its own files printed."""
    extensions = tmp_path_factory.mktemp("extensions")
    path = f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "PYTHONPATH": "", "PATH": path, kernels.CACHE_ENV: str(extensions)}
    python = str(venv / "bin" / "python")
    where = run([python, "-c", "import compute_service; print(compute_service.__file__)"], venv, env)
    built = run([python, "-m", "compute_service.kernels"], venv, env, timeout=2000)
    return env, where.strip(), built


def test_the_installed_package_is_the_wheels_and_its_kernels_compile_from_its_files(venv, installed):
    env, where, built = installed
    assert Path(where).is_relative_to(venv), f"compute_service imported from {where}, not the new environment"
    # compiled here (the log line kernels_build), not found built
    assert "kernels_build" in built, built
    assert built.splitlines()[-1].startswith(f"native kernels: ready in {env[kernels.CACHE_ENV]}"), built
    assert (venv / "bin" / "pagedserve").exists(), "the console script is installed"


def test_the_installed_compute_service_plans_the_native_paths_logs_them_and_serves(venv, installed, tmp_path):
    env = installed[0]
    model = save_tiny_llama(tmp_path / "tiny-llama", initializer_range=0.3)
    with socket_dir() as sockets:
        socket = sockets / "compute.sock"
        argv = [str(venv / "bin" / "python"), "-m", "compute_service", "--model", str(model),
                "--socket", str(socket), "--log-format", "json"]  # fmt: skip
        proc = spawn(argv, tmp_path / "compute.log", env, cwd=venv)
        try:
            target = f"unix:{socket}"
            wait_healthy(target, proc, timeout=300)
            with channel(target) as ch:
                stub = compute_pb2_grpc.ComputeStub(ch)
                info = stub.GetModelInfo(compute_pb2.GetModelInfoRequest(), timeout=30)
                stages = {stage.stage: stage.implementation for stage in info.execution_plan.stages}
                assert info.execution_plan.native_kernels and info.attention_backend == "cpu-native"
                assert (stages["layers.decode"], stages["linears.decoder"]) == (
                    "native-stack",
                    "panels float32",
                )
                pool, handle = shared_pool.create(
                    shared_pool.PoolSpec(
                        num_layers=info.num_layers, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                        num_kv_heads=info.num_kv_heads, head_dim=info.head_dim, dtype=torch.float32,
                    )
                )  # fmt: skip
                try:
                    stub.AttachPool(handle, timeout=30)
                    request = forward_request(
                        [[5, 6, 7, 8, 9]], [0], [[0, 1]], block_size=BLOCK_SIZE, epoch=handle.epoch
                    )
                    reply = stub.Forward(request, timeout=60)
                    assert len(reply.token_ids) == 1 and 0 <= reply.token_ids[0] < info.vocab_size
                    assert pool[:, :, 0:2].abs().sum() > 0, "the step wrote its K/V into the pool"
                finally:
                    shared_pool.release(handle)
        finally:
            assert stop(proc) == 0
    logged = [
        json.loads(line)
        for line in (tmp_path / "compute.log").read_text().splitlines()
        if "execution_plan" in line
    ]
    assert (
        len(logged) == 1
        and logged[0]["native_kernels"] == "built"
        and logged[0]["layers.decode"] == "native-stack"
    )
