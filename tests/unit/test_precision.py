from common.precision import resolve_dtype


def test_auto_is_float32_on_the_cpu_and_bfloat16_on_an_accelerator():
    assert resolve_dtype("auto") == "float32"
    assert resolve_dtype("auto", device_type="cuda") == "bfloat16"
    assert resolve_dtype("auto", device_type="npu") == "bfloat16"


def test_explicit_dtype_is_kept():
    assert resolve_dtype("bfloat16") == "bfloat16"
    assert resolve_dtype("float32", device_type="cuda") == "float32"
