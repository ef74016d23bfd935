"""One bad request never fails its neighbours (real processes, a tiny random-weight model): a NaN temperature
is refused alone by the gateway while three streams run on; and, with the gateway's checks bypassed (a step
hook, tests/step_hooks.py: BadRow, makes one request's Forward rows carry a token id compute refuses),
compute names that row, the gateway fails only that request and runs the step again without it: the three
co-batched streams end with the tokens they have alone. Before, compute refused the whole step and every
request in it failed."""

import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from common.errors import BAD_ROWS_KEY
from common.server import channel
from protos import cache_pb2, cache_pb2_grpc, compute_pb2_grpc
from sdk.client import Client, GenerationError
from tests.forward import forward_request
from tests.helpers import free_port, log_events, start, stop, wait_healthy

pytestmark = pytest.mark.e2e
GATEWAY_SERVICE = "pagedserve.v1.Generation"
BAD_REQUEST = "a-row-compute-refuses"
PROMPTS = [[5, 17, 99, 42, 7], [200, 31, 64, 3, 150, 9, 11], [8, 8, 8]]
GREEDY = dict(max_tokens=120, temperature=0.0, ignore_eos=True)


def start_services(model: Path, logs: Path, hook: str) -> tuple[dict, list[subprocess.Popen]]:
    """Cache, compute and gateway on free 127.0.0.1 ports (the gateway with the step hook `hook`); their
    targets."""
    ports = {name: free_port() for name in ("cache", "compute", "gateway")}
    targets = {name: f"127.0.0.1:{port}" for name, port in ports.items()}
    argv = {
        "cache_service": ["--kv-blocks", "128", "--insecure"],
        "compute_service": ["--model", str(model), "--dtype", "float32", "--threads", "1", "--insecure"],
        "gateway": ["--model", str(model), "--log-format", "json", "--log-level", "debug",
                    "--cache-target", targets["cache"], "--compute-target", targets["compute"],
                    "--step-hook", hook],
    }  # fmt: skip
    procs = []
    for (module, args), name in zip(argv.items(), ports, strict=True):
        proc = start(module, *args, "--port", str(ports[name]), log_path=logs / f"{name}.log")
        procs.append(proc)
        wait_healthy(targets[name], proc, 120, GATEWAY_SERVICE if name == "gateway" else "")
    return targets, procs


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, tiny_model):
    logs = tmp_path_factory.mktemp("logs")
    procs: list[subprocess.Popen] = []
    try:
        targets, procs = start_services(tiny_model, logs, f"tests.step_hooks:BadRow={BAD_REQUEST}")
        yield targets["gateway"], logs / "gateway.log", targets
    finally:
        codes = [stop(proc) for proc in reversed(procs)]
    assert codes == [0] * 3, f"not every service stopped on SIGTERM: {codes}"


@pytest.fixture(scope="module")
def alone(gateway):
    with Client(gateway[0], timeout=60) as client:
        return [client.generate(token_ids=prompt, **GREEDY).token_ids for prompt in PROMPTS]


def three_streams_beside(target: str, bad_request) -> tuple[list[list[int]], Exception | None]:
    """The three prompts streamed at once; once each has a token, `bad_request(client)` runs (its error
    returned); then every stream is read to its end."""
    started = [threading.Event() for _ in PROMPTS]

    def stream(i: int) -> list[int]:
        tokens = []
        for chunk in client.stream(token_ids=PROMPTS[i], **GREEDY):
            tokens += chunk.token_ids
            started[i].set()
        return tokens

    with Client(target, timeout=60) as client, ThreadPoolExecutor(len(PROMPTS)) as pool:
        streams = [pool.submit(stream, i) for i in range(len(PROMPTS))]
        assert all(event.wait(60) for event in started)
        try:
            bad_request(client)
            error = None
        except GenerationError as exc:
            error = exc
        running = sum(not s.done() for s in streams)
        outputs = [s.result(timeout=60) for s in streams]
    assert running == len(PROMPTS), "the bad request ran while the streams were open"
    return outputs, error


def test_a_nan_temperature_is_refused_alone_while_three_streams_complete(gateway, alone):
    outputs, error = three_streams_beside(
        gateway[0], lambda client: client.generate(token_ids=[5, 6, 7], temperature=float("nan"))
    )
    assert error is not None and error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "temperature must be >= 0 and finite" in error.details
    assert outputs == alone


def test_a_row_compute_refuses_fails_only_its_request_and_the_step_runs_again_without_it(gateway, alone):
    target, gateway_log, _ = gateway
    outputs, error = three_streams_beside(
        target, lambda client: client.generate(token_ids=[9, 10, 11], request_id=BAD_REQUEST, **GREEDY)
    )
    assert error is not None and error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "token_ids[" in error.details and "= -1 is outside the vocabulary [0, 256)" in error.details
    assert outputs == alone
    failed = [e for e in log_events(gateway_log) if e["event"] == "step_failed"]
    assert len(failed) == 1 and len(failed[0]["seq_ids"]) == 1, "only the bad request's sequence failed"
    chunks = [e["chunks"] for e in log_events(gateway_log) if e["event"] == "step"]
    assert any(len(c) > 1 and BAD_REQUEST in {row[0] for row in c} for c in chunks), "it was co-batched"


def test_compute_names_the_rows_in_trailing_metadata(gateway):
    """The contract the gateway reads: INVALID_ARGUMENT with `pagedserve-bad-rows` naming the refused rows."""
    targets = gateway[2]
    epoch = (
        cache_pb2_grpc.CacheStub(channel(targets["cache"])).GetStats(cache_pb2.GetStatsRequest()).pool_epoch
    )
    request = forward_request([[1, 2, 3], [4, 300], [5], [6, -2]], [0, 0, 0, 0], [[0], [1], [2], [3]],
                              block_size=16, epoch=epoch)  # fmt: skip
    with pytest.raises(grpc.RpcError) as err:
        compute_pb2_grpc.ComputeStub(channel(targets["compute"])).Forward(request, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("token_ids[4] = 300 is outside the vocabulary")
    assert (BAD_ROWS_KEY, "1,3") in err.value.trailing_metadata()
