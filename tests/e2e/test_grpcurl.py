"""The real grpcurl against the running stack: reflection, describe, streamed Generate, health."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
GRPCURL = str(Path(sys.executable).parent / "grpcurl")


def grpcurl(*args: str) -> str:
    out = subprocess.run([GRPCURL, "-plaintext", *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize(
    ("target", "service"),
    [
        ("target", "pagedserve.v1.Generation"),
        ("cache_target", "pagedserve.v1.Cache"),
        ("compute_target", "pagedserve.v1.Compute"),
    ],
)
def test_list_describe_and_health_on_every_port(stack_fp32, target, service):
    address = getattr(stack_fp32, target)
    # Cache and compute listen on unix sockets: grpcurl -unix PATH.
    at = ["-unix", address.removeprefix("unix:")] if address.startswith("unix:") else [address]
    listed = grpcurl(*at, "list").split()
    assert service in listed and "grpc.health.v1.Health" in listed
    assert f"service {service.rsplit('.', 1)[1]} {{" in grpcurl(*at, "describe", service)
    health = json.loads(grpcurl("-d", json.dumps({"service": service}), *at, "grpc.health.v1.Health/Check"))
    assert health == {"status": "SERVING"}


def test_generate_with_a_json_body_streams_tokens(stack_fp32):
    body = {
        "prompt": "The capital of France is",
        "sampling": {"max_tokens": 4, "temperature": 0},
        "priority": 1,
    }
    out = grpcurl("-d", json.dumps(body), stack_fp32.target, "pagedserve.v1.Generation/Generate")
    # grpcurl prints each streamed message as one JSON object (proto field names).
    messages = json.loads(f"[{out.replace('}' + chr(10) + '{', '},{')}]")
    assert len(messages) == 4
    assert all(len(m["token_ids"]) == 1 for m in messages)
    assert "Paris" in "".join(m.get("text", "") for m in messages)
    assert messages[-1]["finish_reason"] == "FINISH_REASON_LENGTH"
    timings = messages[-1]["timings"]
    assert 0 < timings["time_to_first_token_s"] <= timings["total_s"]


def test_generate_with_stop_strings_logprobs_and_logit_bias_in_json(stack_fp32):
    # docs/api.md's example: "," (token 28) banned, stop at the first ".", two alternatives per token
    sampling = {"max_tokens": 16, "temperature": 0, "stop": ["."], "logprobs": 2, "logit_bias": {"28": -100}}
    body = {"prompt": "The capital of France is", "sampling": sampling}
    out = grpcurl("-d", json.dumps(body), stack_fp32.target, "pagedserve.v1.Generation/Generate")
    messages = json.loads(f"[{out.replace('}' + chr(10) + '{', '},{')}]")
    text = "".join(m.get("text", "") for m in messages)
    assert "Paris" in text and "." not in text and "," not in text
    assert messages[-1]["finish_reason"] == "FINISH_REASON_STOP"
    for m in messages:
        (lp,) = m["logprobs"]
        assert lp["token_id"] == m["token_ids"][0] == lp["top_token_ids"][0]
        assert len(lp["top_logprobs"]) == 2 and lp["logprob"] <= 0
