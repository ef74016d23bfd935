"""The native kernels, C++ compiled from source once per machine into one module: paged attention
(paged_attention.cpp, the cpu-native attention backend) and block-sparse decode's choice of blocks
(sparse_select.cpp, compute_service.attention.sparse), the float32 Llama decoder stack of all-decode steps
(decode_layers.cpp, compute_service.native_decode) and its row-wise ops (row_ops.h; row_ops.cpp runs them on
the other steps, compute_service.llama_layer), the plain-greedy choice of a step's tokens (greedy.cpp,
compute_service.greedy), linear layers on weights packed in panels (panel_linear.cpp,
compute_service.linear) and the machine's FMA and memory-read ceilings (ceilings.cpp, for `pagedserve
bench`); vec.h holds the vector types they share, module.cpp binds them.

`load()` builds them with torch's C++ extension tooling (g++, ninja) into a cache directory keyed by the
sources, the torch version, the compiler flags and the CPU's flags, then imports the module; a later process
imports the cached build. `make setup` builds it ahead (`python -m compute_service.kernels`). A machine that
cannot build it gets None, with the reason logged; the execution plan (compute_service.plan) then names the
pure-torch implementation of every stage.
"""

import contextlib
import functools
import hashlib
import importlib.util
import os
import sys
import time
from pathlib import Path
from types import ModuleType

import structlog
import torch

from common.cpu import cpu_flags, march

HERE = Path(__file__).parent
SOURCES = (
    HERE / "module.cpp",
    HERE / "paged_attention.cpp",
    HERE / "sparse_select.cpp",
    HERE / "decode_layers.cpp",
    HERE / "row_ops.cpp",
    HERE / "greedy.cpp",
    HERE / "panel_linear.cpp",
    HERE / "ceilings.cpp",
)
HEADERS = (
    HERE / "kernels.h",
    HERE / "vec.h",
    HERE / "attention_rows.h",
    HERE / "attention_block.h",
    HERE / "attention_tiles.h",
    HERE / "panel_tiles.h",
    HERE / "row_ops.h",
)
# NOTE: -march=native (common.cpu.march(); x86-64-v3 under PAGEDSERVE_CPU_ISA=avx2) tunes the build to this
# machine's vector units; the cache key includes the compiler flags and the CPU's flags as common.cpu sees
# them, so a build is never loaded on a CPU that lacks an instruction it uses.
# NOTE: reassociation lets the compiler sum a dot product's lanes as a tree of vector adds instead of one lane
# after another (measured: the lane-by-lane sum was the kernel's hottest code); infinities and NaN keep their
# meaning (no -ffinite-math-only), so a row's running max may start at -inf.
# NOTE: -fopenmp turns at::parallel_for (an inline template over `#pragma omp parallel`) into a parallel
# loop; without it the kernels ran on one thread whatever torch's thread count. The build links libgomp by
# its soname, so the process keeps the one OpenMP runtime torch loaded (torch/lib/libgomp.so.1) and
# torch.set_num_threads governs both.
CFLAGS = (
    "-O3",
    "-fopenmp",
    "-fno-math-errno",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
)
CACHE_ENV = "PAGEDSERVE_EXTENSIONS_DIR"
# A build takes about a minute; a lock file older than this is a killed build's.
STALE_LOCK_S = 600.0
log = structlog.get_logger()


def cflags() -> list[str]:
    """The compiler flags: CFLAGS and the -march of common.cpu's profile."""
    return [*CFLAGS, f"-march={march()}"]


def build_dir() -> Path:
    """Where this source, torch and CPU's build lives: $PAGEDSERVE_EXTENSIONS_DIR or ~/.cache/pagedserve."""
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "pagedserve" / "extensions")
    key = hashlib.sha256(
        b"\0".join(
            [path.read_bytes() for path in (*SOURCES, *HEADERS)]
            + [torch.__version__.encode(), " ".join(cflags()).encode()]
            + [" ".join(sorted(cpu_flags())).encode()]
        )
    ).hexdigest()[:16]
    return root / f"kernels-{key}"


@functools.cache
def load() -> ModuleType | None:
    """The compiled kernels' module, built first if this machine has no build yet; None if it cannot be."""
    from torch.utils import cpp_extension

    directory = build_dir()
    # NOTE: a name per directory: torch renames (and so rebuilds) an extension loaded under one name from
    # two directories in one process.
    name = "pagedserve_kernels_" + hashlib.sha256(str(directory).encode()).hexdigest()[:12]
    try:
        built = directory / f"{name}.so"
        if built.exists():
            return _import_built(name, built)
        log.info("kernels_build", directory=str(directory), note="compiling once, about a minute")
        directory.mkdir(parents=True, exist_ok=True)
        _remove_stale_lock(directory / "lock")
        return cpp_extension.load(
            name=name,
            sources=[str(path) for path in SOURCES],
            extra_cflags=cflags(),
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            verbose=False,
        )
    except (OSError, RuntimeError, ImportError, cpp_extension.subprocess.CalledProcessError) as exc:
        reason = (str(exc).strip().splitlines() or [repr(exc)])[-1]
        log.warning("kernels_unavailable", reason=reason, fallback="the pure-torch implementations")
        return None


def _import_built(name: str, path: Path) -> ModuleType:
    """Imports a finished build directly. NOTE: not through cpp_extension.load, which takes the build
    directory's lock file even when nothing needs building: a process killed while holding it (a compute
    stopped during start-up) left every later start waiting on that lock forever."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import the native build {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _remove_stale_lock(lock: Path) -> None:
    """Removes the build lock of a build that cannot still be running (older than STALE_LOCK_S)."""
    with contextlib.suppress(FileNotFoundError):
        age = time.time() - lock.stat().st_mtime
        if age > STALE_LOCK_S:
            lock.unlink()
            log.warning("kernels_stale_lock_removed", path=str(lock), age_s=round(age))


def main() -> None:
    """Builds (or finds) the kernels; exit status 1 when they cannot be built."""
    module = load()
    print(f"native kernels: {'ready in ' + str(build_dir()) if module else 'unavailable'}")
    sys.exit(0 if module else 1)
