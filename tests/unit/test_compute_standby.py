"""A compute's socket lock between real processes: the serving one holds it, a second is refused, a standby
waits on it and takes it the moment the holder dies (compute_service/standby.py)."""

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from compute_service import standby

ROOT = Path(__file__).resolve().parents[2]
HOLDER = textwrap.dedent(
    """
    import sys, time
    from compute_service import standby
    standby.hold(sys.argv[1])
    print("holding", flush=True)
    time.sleep(60)
    """
)
STANDBY = textwrap.dedent(
    """
    import sys, time
    import structlog
    from compute_service import standby
    standby.wait_to_take_over(sys.argv[1], structlog.get_logger())
    print("took over", flush=True)
    time.sleep(60)
    """
)


def python(code: str, socket: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code, str(socket)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )


def comm(proc: subprocess.Popen) -> str:
    return Path(f"/proc/{proc.pid}/comm").read_text().strip()


def test_a_standby_takes_the_socket_when_its_holder_dies_and_a_second_holder_is_refused(tmp_path):
    socket = tmp_path / "compute.sock"
    holder = python(HOLDER, socket)
    waiting = None
    try:
        assert holder.stdout.readline() == "holding\n"
        with pytest.raises(ValueError, match="another compute service serves on .*compute.sock"):
            standby.hold(str(socket))
        waiting = python(STANDBY, socket)
        deadline = time.monotonic() + 30
        while comm(waiting) != standby.WAITING and time.monotonic() < deadline:
            time.sleep(0.05)
        assert comm(waiting) == standby.WAITING
        assert waiting.poll() is None, "it waits while the holder lives"
        holder.send_signal(signal.SIGKILL)
        lines = iter(waiting.stdout.readline, "")
        assert "standby_waiting" in next(lines)
        assert "standby_taking_over" in next(lines)
        assert next(lines) == "took over\n"
        assert comm(waiting) == standby.SERVING
        with pytest.raises(ValueError, match="start this one with --standby"):
            standby.hold(str(socket))
    finally:
        for proc in (holder, waiting):
            if proc is not None:
                proc.kill()
                proc.wait()
