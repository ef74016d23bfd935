"""Compute's thread policy (compute_service.threads): a single stream's step on one thread per physical core,
the topology read from sysfs (common.cpu.physical_cores)."""

import os
from pathlib import Path

import pytest
import torch

from common import cpu
from compute_service.options import OPTIONS
from compute_service.threads import ThreadPolicy


@pytest.fixture
def restored():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("threads", "single", "cores", "expected"),
    [
        (2, None, 2, (2, 2)),
        (2, None, 1, (2, 1)),
        (16, None, 8, (16, 8)),
        (4, None, 8, (4, 4)),
        (2, 1, 2, (2, 1)),
    ],
)
def test_single_stream_threads_default_to_one_per_physical_core(threads, single, cores, expected):
    policy = ThreadPolicy.from_flags(threads, single, cores)
    assert (policy.threads, policy.single_stream) == expected


def test_the_default_threads_are_torchs_and_the_cores_this_machines(restored):
    torch.set_num_threads(3)
    assert ThreadPolicy.from_flags(None, None) == ThreadPolicy(3, min(3, cpu.physical_cores()))


def topology(root: Path, cpus: dict[int, tuple[int, int]]) -> Path:
    """A sysfs cpu tree: cpu N on (package, core)."""
    for n, (package, core) in cpus.items():
        path = root / f"cpu{n}" / "topology"
        path.mkdir(parents=True)
        (path / "physical_package_id").write_text(f"{package}\n")
        (path / "core_id").write_text(f"{core}\n")
    return root


def test_smt_siblings_count_as_one_core_and_an_unreadable_topology_as_one_per_cpu(tmp_path):
    siblings = topology(tmp_path / "smt", {0: (0, 0), 1: (0, 0), 2: (0, 1), 3: (0, 1)})
    assert cpu.physical_cores({0, 1, 2, 3}, siblings) == 2
    assert cpu.physical_cores({0, 2}, siblings) == 2 and cpu.physical_cores({0, 1}, siblings) == 1
    two_packages = topology(tmp_path / "packages", {0: (0, 0), 1: (1, 0)})
    assert cpu.physical_cores({0, 1}, two_packages) == 2, "core ids repeat across packages"
    assert cpu.physical_cores({0, 1, 2}, tmp_path / "none") == 3
    line = cpu.describe(sys_cpus=siblings)
    assert f"{len(os.sched_getaffinity(0))} CPUs on " in line


def test_fewer_than_one_thread_is_refused_with_the_flags_named():
    with pytest.raises(ValueError, match="--threads and --single-stream-threads must be at least 1"):
        ThreadPolicy(2, 0)


def test_a_one_token_step_runs_on_the_single_stream_threads(restored):
    policy = ThreadPolicy(2, 1)
    policy.apply(1)
    assert torch.get_num_threads() == 1
    policy.apply(2)
    assert torch.get_num_threads() == 2
    policy.apply(300)
    assert torch.get_num_threads() == 2


def test_the_flag_parses():
    args = OPTIONS.parser("compute").parse_args(
        ["--model", "m", "--threads", "4", "--single-stream-threads", "2"]
    )
    assert ThreadPolicy.from_flags(args.threads, args.single_stream_threads) == ThreadPolicy(4, 2)
