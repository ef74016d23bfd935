"""The attention backends' names (--attention-backend) and which of them attend block-sparse, declared without
importing the backends: the flags of `python -m compute_service` and `pagedserve up` list them, and the
launcher imports no torch. compute_service.attention.registry holds each backend by its name."""

BACKEND_NAMES = ("cpu", "cpu-native", "cuda", "npu")
# The backends that attend block-sparse under --sparse-attention (compute_service.attention.sparse).
SPARSE = ("cpu-native",)
