"""Which dtype the model runs in when the user says `auto`."""

from pathlib import Path

DTYPE_CHOICES = ("auto", "bfloat16", "float32")
# The dtypes K/V can be stored in (common/shared_pool.py DTYPES); auto: the weights' dtype.
KV_DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2")
# CPU flags of instructions that multiply bfloat16 natively (AVX-512 BF16, AMX).
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else []:
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def resolve_dtype(name: str, flags: frozenset[str] | None = None, device_type: str = "cpu") -> str:
    """`auto` is bfloat16 where the hardware multiplies it natively (a GPU or NPU `device_type`; a CPU with
    the `flags` of NATIVE_BF16_FLAGS), float32 otherwise.

    NOTE: without AVX-512 BF16 or AMX, PyTorch emulates bfloat16 matrix products on the CPU; they run ~30x
    slower than float32 there, so bfloat16 would only halve the weight bytes a decode reads while making
    every prompt crawl.
    """
    if name != "auto":
        return name
    if device_type != "cpu":
        return "bfloat16"
    return "bfloat16" if NATIVE_BF16_FLAGS & (cpu_flags() if flags is None else flags) else "float32"


def resolve_kv_dtype(name: str, weights: str) -> str:
    """The dtype K/V are stored in: `auto` is the weights' (resolved) dtype."""
    assert name in KV_DTYPE_CHOICES, name
    return weights if name == "auto" else name
