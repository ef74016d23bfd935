#!/usr/bin/env bash
# The CUDA checks in one go, for a session lent a GPU machine (run from the repository root there):
#   bash scripts/gpu_check.sh            (results under $OUT, else /tmp/gpu-check)
# 1. $PYTHON (default python3) if it has the project's dependencies, else a venv in /tmp over its packages (--system-site-packages) with the project installed: a CUDA
#    torch the machine has is kept; missing dependencies come from PyPI only (Linux x86_64 torch wheels
#    there are CUDA builds). Where PyPI cannot be reached, give PYTHON an interpreter that has a CUDA torch
#    and the project's dependencies. FLASH_ATTN=1 also tries a prebuilt flash-attn wheel (never a build);
# 2. the CUDA-marked tests (tests/unit/test_cuda.py) and the CPU-side device tests, skip reasons printed;
# 3. scripts/gpu_bench.py: decode and prefill step times through the cuda backend.
# Every step's output lands in $OUT (env.txt, pip.txt, pytest.txt, junit.xml, bench.json, summary.txt);
# a failing step is recorded and the next one still runs.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
has_cuda() { "$1" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }

{ nvidia-smi || true; "$PY" --version; } >"$OUT/env.txt" 2>&1
has_cuda "$PY" && echo "$PY has a CUDA torch" >>"$OUT/env.txt"
if "$PY" -c "import torch, transformers, grpc, structlog, prometheus_client, fastapi, pytest" 2>/dev/null; then
    echo "$PY has the project's dependencies: used as is" >>"$OUT/env.txt"
else
    VENV=/tmp/pagedserve-gpu-venv
    {
        [ -x "$VENV/bin/python" ] || "$PY" -m venv --system-site-packages "$VENV"
        timeout 900 "$VENV/bin/pip" install -q -e '.[dev]'
    } >"$OUT/pip.txt" 2>&1
    PY="$VENV/bin/python"
fi
if [ "${FLASH_ATTN:-0}" = 1 ]; then
    timeout 300 "$PY" -m pip install -q --only-binary=:all: flash-attn >>"$OUT/pip.txt" 2>&1 || true
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'available', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" \
    >>"$OUT/env.txt" 2>&1
"$PY" -c "import flash_attn; print('flash_attn', flash_attn.__version__)" >>"$OUT/env.txt" 2>&1 || true

PYTHONPATH=$PWD timeout 600 "$PY" -m pytest -q -rs -p no:cacheprovider --junitxml="$OUT/junit.xml" \
    tests/unit/test_cuda.py tests/unit/test_device_backends.py tests/unit/test_device_pools.py \
    >"$OUT/pytest.txt" 2>&1
tests_rc=$?
PYTHONPATH=$PWD timeout 300 "$PY" scripts/gpu_bench.py "$OUT/bench.json" >"$OUT/bench.txt" 2>&1
bench_rc=$?
{
    echo "tests exit $tests_rc: $(tail -n 1 "$OUT/pytest.txt")"
    echo "bench exit $bench_rc"
    cat "$OUT/bench.json" 2>/dev/null
} | tee "$OUT/summary.txt"
