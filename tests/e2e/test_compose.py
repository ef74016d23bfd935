"""docker-compose.yml's commands are real: each service's command, environment and health check run here as
local processes (ports and hosts substituted through the file's own variables), then a generation passes."""

import re
import shutil
import subprocess
import sys
import time

import pytest
import yaml

from common.model_files import cache_root
from sdk.client import Client
from tests import helpers

pytestmark = pytest.mark.e2e
COMPOSE = helpers.ROOT / "docker-compose.yml"
VARIABLE = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")


def interpolate(value, env: dict[str, str]):
    """Compose's `${NAME:-default}` substitution over a loaded YAML tree."""
    if isinstance(value, str):
        return VARIABLE.sub(lambda m: env.get(m[1], m[2] or ""), value)
    if isinstance(value, list):
        return [interpolate(item, env) for item in value]
    if isinstance(value, dict):
        return {key: interpolate(item, env) for key, item in value.items()}
    return value


def local(argv: list[str]) -> list[str]:
    assert argv[:2] == ["python", "-m"], argv
    return [sys.executable, *argv[1:]]


def wait_healthy(name: str, proc: subprocess.Popen, check: list[str], timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while subprocess.run(check, capture_output=True, timeout=30).returncode != 0:
        assert proc.poll() is None, f"{name} exited:\n{helpers.log_tail(proc)}"
        assert time.monotonic() < deadline, f"{name} not healthy:\n{helpers.log_tail(proc)}"
        time.sleep(1)


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose missing: run `make setup`")
def test_compose_file_is_valid():
    out = subprocess.run(
        ["docker-compose", "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr


def test_compose_services_run_as_written(tmp_path):
    env = {"BIND_HOST": "127.0.0.1", "CACHE_HOST": "127.0.0.1", "COMPUTE_HOST": "127.0.0.1"}
    env |= {"DTYPE": "float32", "KV_MEMORY": "64MiB", "LOG_FORMAT": "console"}
    for name in ("GATEWAY", "CACHE", "COMPUTE"):
        env[f"{name}_PORT"], env[f"{name}_METRICS_PORT"] = str(helpers.free_port()), str(helpers.free_port())
    services = interpolate(yaml.safe_load(COMPOSE.read_text())["services"], env)
    assert services["compute"]["ipc"] == "service:cache" and services["cache"]["ipc"] == "shareable"
    assert set(services["gateway"]["depends_on"]) == {"cache", "compute"}
    procs: dict[str, subprocess.Popen] = {}
    try:
        for name in ("cache", "compute", "gateway"):
            service = services[name]
            # NOTE: the image's /models volume is this machine's converted-model cache.
            service_env = {**service.get("environment", {}), "PAGEDSERVE_CACHE_DIR": str(cache_root())}
            argv = local(service["command"])
            procs[name] = helpers.start(
                argv[2], *argv[3:], log_path=tmp_path / f"{name}.log", env=service_env
            )
            wait_healthy(name, procs[name], local(service["healthcheck"]["test"][1:]))
        with Client(f"127.0.0.1:{env['GATEWAY_PORT']}", timeout=120) as client:
            result = client.generate(prompt="The capital of France is", max_tokens=4, temperature=0)
        assert "Paris" in result.text
    finally:
        for proc in reversed(procs.values()):
            helpers.stop(proc)
