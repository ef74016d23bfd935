"""`pagedserve bench` against a running stack, as a user runs it."""

import json
import subprocess

import pytest

from tests.e2e.stack import PAGEDSERVE

pytestmark = pytest.mark.e2e


def test_bench_latency_writes_the_table_and_json(stack_fp32, tmp_path):
    out = subprocess.run(
        [PAGEDSERVE, "bench", "--workload", "latency", "--no-peers", "--target", stack_fp32.target,
         "--cache-target", stack_fp32.cache_target, "--json", str(tmp_path / "bench.json")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "inter-token p50 (ms)" in out.stdout
    figures = json.loads((tmp_path / "bench.json").read_text())["pagedserve"]
    assert figures["generated_tokens"] == 128
    assert figures["prompt_tokens"] == 256
    assert figures["tokens_per_s"] > 0 and figures["itl_p50_ms"] > 0
    assert figures["peak_used_blocks"] >= 256 // 16
    assert stack_fp32.stats().used_blocks == 0
