"""--weights: the ways linear layers may hold their weights (compute_service.quantized quantises them).
NOTE: no torch here: `pagedserve up` declares the flag, and its launcher imports no torch."""

WEIGHTS_CHOICES = ("auto", "float32", "bfloat16", "int8", "int4")
# Inputs sharing one int4 scale and zero point (the kernel accepts 32, 64, 128, 256; 32 is the most exact).
INT4_GROUP_SIZE = 32
