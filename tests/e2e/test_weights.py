"""--weights end to end on `pagedserve up` stacks of a tiny random-weight model: int8 and int4 serve (prompts
large enough for the dense GEMM, decode steps on the quantised kernel), GetInfo, metrics and `pagedserve
stats --compute-target` name the mode, and a combination compute cannot run is refused at start with a
message naming the fix."""

import json
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from compute_service.plan import STAGES
from compute_service.quantized import QUANTIZED_MAX_ROWS
from tests.e2e.stack import stacks_side_by_side
from tests.helpers import ROOT

pytestmark = pytest.mark.e2e

MODES = ("int8", "int4")
PROMPT = [5, 17, 200, 33, 9, 61, 140, 7, 88, 3, 250, 19, 44, 100, 2, 71, 12, 90, 31, 8]
GREEDY = dict(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model


@pytest.fixture(scope="module")
def stacks(model, logs):
    flags = ("--model", str(model), "--dtype", "float32", "--kv-blocks", "64")
    with stacks_side_by_side(logs, flags, "--weights", MODES) as started:
        yield started


@pytest.mark.parametrize("mode", MODES)
def test_each_quantised_mode_serves_concurrent_requests(stacks, mode):
    assert len(PROMPT) > QUANTIZED_MAX_ROWS, "the prompt's prefill takes the dense GEMM"
    with stacks[mode].client() as client, ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda k: client.generate(token_ids=PROMPT[k:], **GREEDY), range(4)))
        again = client.generate(token_ids=PROMPT[1:], **GREEDY)
    assert all(len(r.token_ids) == 8 and r.finish_reason == "length" for r in results)
    assert all(0 <= t < 256 for r in results for t in r.token_ids)
    assert len(again.token_ids) == 8


@pytest.mark.parametrize("mode", MODES)
def test_info_and_metrics_name_the_weights_mode(stacks, mode):
    stack = stacks[mode]
    with stack.client() as client:
        info = client.info()
    assert (info.dtype, info.weights) == ("float32", mode)
    compute = urllib.request.urlopen(stack.metrics_url("compute"), timeout=10).read().decode()
    line = next(line for line in compute.splitlines() if line.startswith("pagedserve_compute_info{"))
    assert f'weights="{mode}"' in line and 'dtype="float32"' in line
    command = [sys.executable, "-m", "cli", "stats", "--json", "--cache-target", stack.cache_target]
    stats = subprocess.run(
        [*command, "--compute-target", stack.compute_target],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert stats.returncode == 0, stats.stderr
    compute = json.loads(stats.stdout)["compute"]
    assert (compute["weights"], compute["dtype"], compute["kv_dtype"]) == (mode, "float32", "float32")
    plan = compute["execution_plan"]
    assert list(plan["stages"]) == list(STAGES) and plan["architecture"] == "llama"
    decoder, head = plan["stages"]["linears.decoder"], plan["stages"]["linears.head"]
    # a float32 model multiplies native int8 or int4 panels where the kernels build, else torch's kernels
    expected = f"panels {mode}" if plan["native_kernels"] else f"weight-only {mode} up to"
    assert decoder["implementation"].startswith(expected) and decoder["reason"]
    assert "int8" in head["implementation"] and "output head is int8" in head["reason"]
    as_table = [word for word in command if word != "--json"] + ["--compute-target", stack.compute_target]
    table = subprocess.run(as_table, cwd=ROOT, capture_output=True, text=True, timeout=60)
    rows = dict(line.split(None, 1) for line in table.stdout.splitlines())
    assert rows["compute.plan.linears.decoder"].startswith(decoder["implementation"])


@pytest.mark.parametrize(
    ("flags", "message"),
    [(("--dtype", "bfloat16", "--weights", "float32"), "pass --dtype float32, or --weights auto|int8|int4"),
     (("--dtype", "float32", "--weights", "int4", "--plain-linear"), "cannot combine with --weights int4"),
     (("--dtype", "float32", "--weights", "bfloat16", "--plain-linear"),
      "cannot combine with --weights bfloat16")],
)  # fmt: skip
def test_compute_refuses_a_combination_it_cannot_run(model, tmp_path, flags, message):
    command = [sys.executable, "-m", "compute_service", "--model", str(model), *flags]
    command += ["--socket", str(tmp_path / "compute.sock")]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert message in result.stderr
    assert not (tmp_path / "compute.sock").exists()
