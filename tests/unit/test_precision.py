from pathlib import Path

from common.precision import cpu_flags, resolve_dtype


def test_auto_is_float32_on_the_cpu_and_bfloat16_on_an_accelerator():
    assert resolve_dtype("auto") == "float32"
    assert resolve_dtype("auto", device_type="cuda") == "bfloat16"
    assert resolve_dtype("auto", device_type="npu") == "bfloat16"


def test_explicit_dtype_is_kept():
    assert resolve_dtype("bfloat16") == "bfloat16"
    assert resolve_dtype("float32", device_type="cuda") == "float32"


def test_cpu_flags_reads_the_flags_line(tmp_path: Path):
    cpuinfo = tmp_path / "cpuinfo"
    cpu = "flags\t\t: fpu avx2 amx_bf16\n"
    cpuinfo.write_text(f"processor\t: 0\n{cpu}\nprocessor\t: 1\n{cpu}")
    assert cpu_flags(cpuinfo) == frozenset({"fpu", "avx2", "amx_bf16"})
    assert cpu_flags(tmp_path / "missing") == frozenset()
