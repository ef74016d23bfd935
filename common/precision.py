"""Which dtype the model runs in when the user says `auto`."""

DTYPE_CHOICES = ("auto", "bfloat16", "float32")
# The dtypes K/V can be stored in (common/shared_pool.py DTYPES); auto: the weights' dtype.
KV_DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2")


def resolve_dtype(name: str, device_type: str = "cpu") -> str:
    """`auto` is bfloat16 on a GPU or NPU `device_type`, float32 on the CPU.

    NOTE: float32 on every CPU, also one that multiplies bfloat16 natively (AVX-512 BF16, AMX): there only
    the linear layers gain from bfloat16 (`--weights bfloat16`, mixed precision), while a whole-bfloat16
    model leaves the native decode stack and attention kernel (float32 only) for torch's generic ops, and
    runs slower (`pagedserve bench --workload throughput --dtype bfloat16` against `--dtype float32` shows
    it). Without native bfloat16, PyTorch emulates its matrix products, far slower than float32.
    """
    if name != "auto":
        return name
    return "float32" if device_type == "cpu" else "bfloat16"


def resolve_kv_dtype(name: str, weights: str) -> str:
    """The dtype K/V are stored in: `auto` is the weights' (resolved) dtype."""
    assert name in KV_DTYPE_CHOICES, name
    return weights if name == "auto" else name
