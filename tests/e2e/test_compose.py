"""docker-compose.yml's commands are real: each service's command, environment and health check run here as
local processes (ports and hosts substituted through the file's own variables, volumes by local directories),
then a generation passes, with the KV events and the HTTP /metrics its variables turn on. The file is closed
by default: only the gateway's port is published, and cache and compute take only mutual-TLS callers with
certificates from the `certs` service."""

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest
import yaml

from cache_service.server import parse_args as cache_args
from cli import certs
from common import healthcheck
from common.model_files import cache_root
from compute_service.server import parse_args as compute_args
from gateway.server import parse_args as gateway_args
from sdk.client import Client
from tests import helpers
from tests.e2e.prompts import long_text
from tests.kv_event_stream import Subscriber

pytestmark = pytest.mark.e2e
COMPOSE = helpers.ROOT / "docker-compose.yml"
METRICS = helpers.ROOT / "docker-compose.metrics.yml"
EVENTS = helpers.ROOT / "docker-compose.events.yml"
TOPIC = "kv@compose@smollm2"
PARSERS = {"cache_service": cache_args, "compute_service": compute_args, "gateway": gateway_args}
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


def local(argv: list[str], mounts: dict[str, str] | None = None) -> list[str]:
    """argv run here: this python, each volume's mount point (a whole argument) replaced by its directory."""
    assert argv[:2] == ["python", "-m"], argv
    return [sys.executable, *((mounts or {}).get(arg, arg) for arg in argv[1:])]


def mounts_of(service: dict, volumes: dict[str, str]) -> dict[str, str]:
    """A service's mount points (`name:/path[:ro]`) -> the local directory standing for volume `name`."""
    return {spec.split(":")[1]: volumes[spec.split(":")[0]] for spec in service.get("volumes", [])}


def certs_command(argv: list[str]) -> argparse.Namespace:
    commands = argparse.ArgumentParser().add_subparsers()
    certs.add_parser(commands)
    assert argv[:4] == ["python", "-m", "cli", "certs"], argv
    return commands.choices["certs"].parse_args(argv[4:])


def stored_blocks(subscriber: Subscriber) -> list[dict]:
    return [event for m in subscriber.messages() for event in m.batch[1] if event["type"] == "BlockStored"]


def wait_healthy(name: str, proc: subprocess.Popen, check: list[str], timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while subprocess.run(check, capture_output=True, timeout=30).returncode != 0:
        assert proc.poll() is None, f"{name} exited:\n{helpers.log_tail(proc)}"
        assert time.monotonic() < deadline, f"{name} not healthy:\n{helpers.log_tail(proc)}"
        time.sleep(1)


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose missing: run `make setup`")
@pytest.mark.parametrize(
    "files",
    [[COMPOSE], [COMPOSE, METRICS], [COMPOSE, EVENTS], [COMPOSE, METRICS, EVENTS]],
    ids=["closed", "with-metrics", "with-events", "with-both"],
)
def test_compose_file_is_valid(files):
    argv = ["docker-compose", *(arg for path in files for arg in ("-f", str(path))), "config", "-q"]
    env = {**os.environ, "KV_EVENTS_ENDPOINT": "tcp://*:5557", "HTTP_METRICS": "on"}
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr


def test_compose_publishes_only_the_gateway_and_runs_the_plane_on_mtls():
    services = interpolate(yaml.safe_load(COMPOSE.read_text())["services"], {})
    assert [name for name, service in services.items() if "ports" in service] == ["gateway"]
    assert services["gateway"]["ports"] == ["50051:50051", "8000:8000"], "not even /metrics unless asked"
    certs_args = certs_command(services["certs"]["command"])
    assert (certs_args.out, certs_args.force) == ("/certs", False), "idempotent: kept across restarts"
    assert services["certs"]["restart"] == "no"
    for name, identity in (("cache", "cache"), ("compute", "compute"), ("gateway", "gateway")):
        service = services[name]
        module, argv = service["command"][2], service["command"][3:]
        args = PARSERS[module](argv)
        assert args.internal_certs == "/certs" and "certs:/certs:ro" in service["volumes"]
        assert not getattr(args, "insecure", False) and not getattr(args, "socket", None)
        check = healthcheck.parser().parse_args(service["healthcheck"]["test"][4:])
        if name != "gateway":
            assert service["depends_on"]["certs"] == {"condition": "service_completed_successfully"}
            assert (check.internal_certs, check.identity) == ("/certs", identity), "its own certificate"
    metrics = yaml.safe_load(METRICS.read_text())["services"]
    assert {name: len(service["ports"]) for name, service in metrics.items()} == dict.fromkeys(
        ("cache", "compute", "gateway"), 1
    )
    cache, gateway = (
        PARSERS[services[n]["command"][2]](services[n]["command"][3:]) for n in ("cache", "gateway")
    )
    assert cache.kv_events_endpoint is None and gateway.http_metrics == "off", "no events, no HTTP /metrics"
    events = interpolate(yaml.safe_load(EVENTS.read_text())["services"], {})
    assert events == {"cache": {"ports": ["5557:5557", "5558:5558"]}}


@pytest.fixture
def events_endpoint():
    with helpers.socket_dir() as sockets:
        yield f"ipc://{sockets}/events"


def test_compose_services_run_as_written(tmp_path, events_endpoint):
    volumes = {"certs": str(tmp_path / "certs"), "models": str(cache_root())}
    env = {"BIND_HOST": "127.0.0.1", "CACHE_HOST": "127.0.0.1", "COMPUTE_HOST": "127.0.0.1"}
    env |= {"DTYPE": "float32", "KV_MEMORY": "64MiB", "LOG_FORMAT": "console"}
    env |= {"KV_EVENTS_ENDPOINT": events_endpoint, "KV_EVENTS_TOPIC": TOPIC, "HTTP_METRICS": "on"}
    for name in ("GATEWAY", "CACHE", "COMPUTE"):
        env[f"{name}_PORT"], env[f"{name}_METRICS_PORT"] = str(helpers.free_port()), str(helpers.free_port())
    env["HTTP_PORT"] = str(helpers.free_port())
    services = interpolate(yaml.safe_load(COMPOSE.read_text())["services"], env)
    assert services["compute"]["ipc"] == "service:cache" and services["cache"]["ipc"] == "shareable"
    assert set(services["gateway"]["depends_on"]) == {"cache", "compute"}
    one_shot = local(services["certs"]["command"], mounts_of(services["certs"], volumes))
    for _ in range(2):
        assert subprocess.run(one_shot, cwd=helpers.ROOT, timeout=60, capture_output=True).returncode == 0
    procs: dict[str, subprocess.Popen] = {}
    subscriber = None
    try:
        for name in ("cache", "compute", "gateway"):
            service = services[name]
            mounts = mounts_of(service, volumes)
            # NOTE: the image's /models volume is this machine's converted-model cache.
            service_env = {**service.get("environment", {}), "PAGEDSERVE_CACHE_DIR": str(cache_root())}
            argv = local(service["command"], mounts)
            procs[name] = helpers.start(
                argv[2], *argv[3:], log_path=tmp_path / f"{name}.log", env=service_env
            )
            wait_healthy(name, procs[name], local(service["healthcheck"]["test"][1:], mounts))
            subscriber = subscriber or Subscriber(events_endpoint, TOPIC.encode())
        with Client(f"127.0.0.1:{env['GATEWAY_PORT']}", timeout=120) as client:
            result = client.generate(prompt="The capital of France is", max_tokens=4, temperature=0)
            client.generate(prompt=long_text(3), max_tokens=1)  # a prompt of whole blocks: events
        assert "Paris" in result.text
        health = urllib.request.urlopen(f"http://127.0.0.1:{env['HTTP_PORT']}/health", timeout=30)
        assert health.status == 200, "the OpenAI-compatible API is served on HTTP_PORT"
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{env['HTTP_PORT']}/metrics", timeout=30).read()
        assert b"vllm:num_requests_running{" in metrics, "HTTP_METRICS=on: /metrics on HTTP_PORT"
        deadline = time.monotonic() + 30
        while not stored_blocks(subscriber):
            assert time.monotonic() < deadline, "KV_EVENTS_ENDPOINT: the cache publishes its blocks"
            time.sleep(0.1)
        plaintext = subprocess.run(
            [sys.executable, "-m", "common.healthcheck", f"127.0.0.1:{env['CACHE_PORT']}"],
            cwd=helpers.ROOT, capture_output=True, timeout=30,
        )  # fmt: skip
        assert plaintext.returncode == 1, "the cache refuses a caller without a certificate"
    finally:
        for proc in reversed(procs.values()):
            helpers.stop(proc)
        if subscriber is not None:
            subscriber.close()
