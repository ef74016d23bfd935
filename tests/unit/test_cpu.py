"""The one place that says what the CPU can do, and its avx2 profile for running as an AVX2-only machine."""

from pathlib import Path

import pytest

from common import cpu
from compute_service import kernels

SAPPHIRE_RAPIDS = "fpu sse4_2 avx avx2 fma f16c bmi2 avx512f avx512bw avx512_bf16 avx_vnni amx_tile amx_bf16"


@pytest.fixture
def cpuinfo(tmp_path: Path) -> Path:
    path = tmp_path / "cpuinfo"
    cpu_lines = f"model name\t: Example Xeon\nflags\t\t: {SAPPHIRE_RAPIDS}\n"
    path.write_text(f"processor\t: 0\n{cpu_lines}\nprocessor\t: 1\n{cpu_lines}")
    return path


def test_the_native_profile_reads_the_flags_line(cpuinfo, tmp_path, monkeypatch):
    monkeypatch.delenv(cpu.ISA_ENV, raising=False)
    assert cpu.cpu_flags(cpuinfo) == frozenset(SAPPHIRE_RAPIDS.split())
    assert cpu.cpu_flags(tmp_path / "missing") == frozenset()
    assert cpu.march() == "native" and cpu.isa_level(cpu.cpu_flags(cpuinfo)) == "AMX"


def test_the_avx2_profile_sees_an_x86_64_v3_machine(cpuinfo, monkeypatch):
    monkeypatch.setenv(cpu.ISA_ENV, "avx2")
    assert cpu.cpu_flags(cpuinfo) == frozenset(["fpu", "sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"])
    assert cpu.march() == "x86-64-v3" and not cpu.bfloat16_native()
    assert cpu.isa_level(cpu.cpu_flags(cpuinfo)) == "AVX2"
    line = cpu.describe(cpuinfo)
    assert line.startswith("Example Xeon, ") and "AVX2 (profile avx2" in line


def test_an_unknown_profile_is_refused_with_the_choices(monkeypatch):
    monkeypatch.setenv(cpu.ISA_ENV, "avx1024")
    with pytest.raises(cpu.IsaError, match="PAGEDSERVE_CPU_ISA='avx1024': choose one of native, avx2"):
        cpu.march()


def test_each_profile_builds_the_native_kernels_apart(monkeypatch):
    monkeypatch.setenv(cpu.ISA_ENV, "native")
    native_dir, native_flags = kernels.build_dir(), kernels.cflags()
    monkeypatch.setenv(cpu.ISA_ENV, "avx2")
    assert kernels.build_dir() != native_dir
    assert "-march=x86-64-v3" in kernels.cflags() and "-march=native" in native_flags


def test_the_isa_levels_in_order():
    assert cpu.isa_level(frozenset({"avx2", "avx512f"})) == "AVX-512"
    assert cpu.isa_level(frozenset({"sse2"})) == "baseline"
