"""A child process playing compute's side of the session fence (common/session_fence.py): it holds a
session's slot as a step does, and lets it go, on request; for tests of what the cache does meanwhile."""

import subprocess
import sys
import textwrap

from tests.helpers import ROOT

# Compute's side in a child: holds the slot of EPOCH for each line read ("hold"), lets it go ("release").
COMPUTE = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from common.session_fence import SessionFence
    from protos import common_pb2
    handle = common_pb2.PoolHandle.FromString(bytes.fromhex(sys.argv[1]))
    fence = SessionFence.open(handle, Path(sys.argv[2]))
    for line in sys.stdin:
        verb, slot, epoch = line.split()
        if verb == "hold":
            print(fence.hold(int(slot), int(epoch)), flush=True)
        elif verb == "holds":
            print(fence.holds(int(slot), int(epoch)), flush=True)
        else:
            fence.release(int(slot))
            print("released", flush=True)
    """
)


class Compute:
    """The child process playing compute."""

    def __init__(self, handle, shm_dir) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", COMPUTE, handle.SerializeToString().hex(), str(shm_dir)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
        )  # fmt: skip

    def ask(self, verb: str, slot: int, epoch: int) -> str:
        self.proc.stdin.write(f"{verb} {slot} {epoch}\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
