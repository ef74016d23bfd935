"""The machine's own ceilings, measured by the native kernels (compute_service/kernels/ceilings.cpp) on as
many threads as compute runs (torch's default: one per core): float32 FMA GFLOP/s and the GB/s those threads
read memory at. `python -m cli.bench.ceilings` prints them as JSON; the bench runs it in a process of its
own, before its workloads, so that its own process loads no torch."""

import json
import subprocess
import sys

# Seconds each ceiling is measured for, and the buffer read (well past any last-level cache).
SECONDS = 2.0
READ_MEGABYTES = 1024


def measure() -> dict:
    """The ceilings as `main` prints them; RuntimeError where the native kernels cannot be built."""
    done = subprocess.run([sys.executable, "-m", __name__], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the machine's ceilings could not be measured: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout)


def main() -> int:
    import torch

    from common.cpu import describe
    from compute_service import kernels

    native = kernels.load()
    if native is None:
        print("the native kernels are unavailable: no ceilings", file=sys.stderr)
        return 1
    fma = native.fma_gflops(SECONDS)
    read = native.read_gbps(READ_MEGABYTES, SECONDS)
    ceilings = {"fma_gflop_per_s": fma, "read_gb_per_s": read, "threads": torch.get_num_threads()}
    print(json.dumps({**ceilings, "machine": describe()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
