"""`pagedserve up` and `pagedserve generate` as a user runs them, on a deliberately small KV pool."""

import importlib
import re
import signal
import subprocess
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

import cli.main
from cli import runtime_dir
from cli.processes import services_of
from cli.scrape import scrape
from sdk.client import GenerationError
from tests import helpers
from tests.e2e.prompts import prompt_ids
from tests.e2e.stack import SMALL_KV_BLOCKS
from tests.helpers import PAGEDSERVE

pytestmark = pytest.mark.e2e


def test_the_pagedserve_script_is_cli_main():
    """The tests run `python -m cli`; the installed `pagedserve` script must start the same main."""
    scripts = tomllib.loads((helpers.ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"pagedserve": "cli.main:main"}
    module, _, name = scripts["pagedserve"].partition(":")
    assert getattr(importlib.import_module(module), name) is cli.main.main
    assert "from cli.main import main\n\nmain()" in (helpers.ROOT / "cli" / "__main__.py").read_text()


def _segments() -> set[Path]:
    return set(Path("/dev/shm").glob("pagedserve-kv-*"))


def _cache_pid(up: subprocess.Popen) -> int:
    """The pid of the cache service that `pagedserve up` started: it names the pool segment."""
    for proc_dir in Path("/proc").glob("[0-9]*"):
        try:
            cmdline = (proc_dir / "cmdline").read_bytes()
            ppid = int((proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == up.pid and b"cache_service" in cmdline:
            return int(proc_dir.name)
    raise AssertionError("pagedserve up started no cache service")


def test_generate_command_streams_to_stdout(small_stack):
    out = subprocess.run(
        [*PAGEDSERVE, "generate", "The capital of France is", "--max-tokens", "8", "--temperature", "0",
         "--priority", "-2", "--target", small_stack.target],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    summary = r"\[(length|stop): 5 prompt tokens \(0 cached\), \d+ generated; queued ([\d.]+)s, "
    summary += r"first token ([\d.]+)s, total ([\d.]+)s\]"
    queued, first, total = map(float, re.search(summary, out.stderr).groups()[1:])
    assert queued <= first <= total


def test_generate_command_reports_errors(small_stack):
    out = subprocess.run(
        [*PAGEDSERVE, "generate", "hi", "--max-tokens", "-1", "--target", small_stack.target],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 1
    assert "INVALID_ARGUMENT" in out.stderr and "max_tokens must be >= 0" in out.stderr


def test_prompt_larger_than_the_pool_is_resource_exhausted(small_stack, tokenizer):
    (ids,) = prompt_ids(tokenizer, [SMALL_KV_BLOCKS * 16 + 10])
    with small_stack.client() as client, pytest.raises(GenerationError) as err:
        client.generate(token_ids=ids, max_tokens=4)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--kv-memory" in err.value.details
    assert small_stack.stats().used_blocks == 0


def test_running_out_of_blocks_preempts_instead_of_failing(small_stack, tokenizer):
    # 6 prompts of 90 tokens + 40 new need 6 * 9 = 54 blocks at the end; the pool has 24.
    prompts = prompt_ids(tokenizer, [90] * 6)
    before = _preemptions(small_stack)
    with small_stack.client() as client:
        alone = [
            client.generate(token_ids=p, max_tokens=40, temperature=0.0, ignore_eos=True) for p in prompts[:2]
        ]
        with ThreadPoolExecutor(len(prompts)) as pool:
            together = list(
                pool.map(
                    lambda p: client.generate(token_ids=p, max_tokens=40, temperature=0.0, ignore_eos=True),
                    prompts,
                )
            )
    assert [r.token_ids for r in together[:2]] == [r.token_ids for r in alone]
    assert all(len(r.token_ids) == 40 for r in together)
    assert _preemptions(small_stack) > before
    assert small_stack.stats().used_blocks == 0


def _preemptions(stack) -> float:
    return scrape(stack.metrics_url("gateway"))["pagedserve_preemptions_total", ()]


def test_up_prints_ready_and_cleans_up_on_sigint(model_dir, logs):
    before = _segments()
    ours = set()
    port, http = helpers.free_port(), helpers.free_port()
    proc = subprocess.Popen(
        [*PAGEDSERVE, "up", "--port", str(port), "--http-port", str(http), "--kv-blocks", "32"],
        cwd=helpers.ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        lines = []
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "pagedserve up exited before it was ready:\n" + "".join(lines[-30:])
            lines.append(line)
            if "pagedserve ready" in line:
                break
        assert f"127.0.0.1:{port}" in lines[-1] and str(runtime_dir.default_path(port)) in lines[-1]
        assert proc.stdout.readline() == f"OpenAI-compatible API on http://127.0.0.1:{http}/v1\n"
        ours = {p for p in _segments() - before if p.name.startswith(f"pagedserve-kv-{_cache_pid(proc)}-")}
        assert len(ours) == 1, "the cache service maps one pool segment"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        helpers.stop(proc)
    assert not ours & _segments(), "the pool segment is removed on shutdown"
    assert not runtime_dir.default_path(port).exists(), "the sockets and their directory are removed"


def _maps_torch(pid: int) -> bool:
    """Whether process pid has torch's libraries mapped."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_the_launcher_and_the_gateway_run_without_torch(small_stack):
    with small_stack.client() as client:
        reply = client.generate(messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0.0)
    assert reply.usage.prompt_tokens > 0
    services = services_of(small_stack.proc.pid)
    assert not _maps_torch(small_stack.proc.pid), "the launcher"
    assert not _maps_torch(services["gateway"]), "the gateway, after a chat request"
    assert _maps_torch(services["compute"]), "compute runs the model on torch"
