"""`pagedserve bench` against a running stack, as a user runs it."""

import json
import os
import subprocess
from datetime import UTC, datetime

import pytest

from cli.bench.workloads import LONG_PREFIX_TOKENS, build
from common.cpu import describe
from gateway.config import DEFAULT_DECODE_STEPS
from tests import llamacpp_protocol_server
from tests.helpers import PAGEDSERVE
from tests.tiny_model import save_tiny_llama

pytestmark = pytest.mark.e2e


def test_bench_latency_writes_the_table_json_and_profile(stack_fp32, tmp_path):
    out = subprocess.run(
        [*PAGEDSERVE, "bench", "--workload", "latency", "--no-peers", "--target", stack_fp32.target,
         "--cache-target", stack_fp32.cache_target, "--json", str(tmp_path / "bench.json"),
         "--profile", "--metrics-url", stack_fp32.metrics_url("gateway")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "inter-token p50 (ms)" in out.stdout
    assert "orchestration overhead" in out.stdout
    result = json.loads((tmp_path / "bench.json").read_text())
    figures = result["pagedserve"]
    assert figures["generated_tokens"] == 128
    assert figures["prompt_tokens"] == 256
    assert figures["tokens_per_s"] > 0 and figures["itl_p50_ms"] > 0
    assert figures["peak_used_blocks"] >= 256 // 16
    # 256 prompt tokens fill 16 blocks; then at worst 257 tokens in the blocks of a multi-step call's
    # lookahead (DEFAULT_DECODE_STEPS - 1 tokens more)
    assert 257 / (16 * -(-(256 + DEFAULT_DECODE_STEPS) // 16)) <= figures["kv_utilisation_mean"] <= 1
    assert result["block_size"] == 16
    assert stack_fp32.stats().used_blocks == 0

    # one prefill step, then one decode step per further token; compute's split inside the step's wall
    prefill, decode = result["profile"]["prefill"], result["profile"]["decode"]
    assert prefill["steps"] == 1 and decode["steps"] == 127
    for kind in (prefill, decode):
        phases = kind["phases_ms"]
        assert 0 < phases["compute_attention"] < phases["compute_model"]
        assert phases["compute_rpc"] < kind["step_ms"]
        assert phases["cache_rpc"] > 0 and phases["compute_prepare"] > 0
    # a Forward's wait holds compute's whole step; in a multi-step call compute runs the next step while the
    # gateway handles a reply, so the gateway's wall between decode replies is compute's step, give or take
    # the two processes' clocks: the model's share of a decode step is near all of it, never far over
    phases = prefill["phases_ms"]
    assert phases["compute_model"] + phases["compute_sample"] < phases["compute_rpc"]
    assert 0 < prefill["overhead_pct"] < 100
    assert -5 < decode["overhead_pct"] < 100


def test_bench_refuses_plain_linear_against_a_running_stack():
    out = subprocess.run(
        [*PAGEDSERVE, "bench", "--workload", "latency", "--target", "127.0.0.1:1", "--plain-linear"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode != 0
    assert "--plain-linear applies to a stack the bench starts, not --target" in out.stderr


def test_shared_prefix_bench_also_runs_with_the_prefix_cache_off(tmp_path, tokenizer):
    """The bench starts its own stacks (a random-weight model, so it is quick): the workload's second run
    computes every prompt token, the first takes the system prompt from the prefix cache."""
    model = save_tiny_llama(tmp_path / "tiny", max_position_embeddings=1024)
    tokenizer.save_pretrained(model)
    out = subprocess.run(
        [*PAGEDSERVE, "bench", "--workload", "shared-prefix", "--model", str(model), "--dtype", "float32",
         "--no-peers", "--json", str(tmp_path / "bench.json")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "vs prefix cache off" in out.stdout
    result = json.loads((tmp_path / "bench.json").read_text())
    ours, off = result["pagedserve"], result["peers"]["prefix cache off"]
    assert set(result["peers"]) == {"prefix cache off"}, "--no-peers skips generate_batch and generate"
    assert off["cached_prompt_tokens"] == 0
    # 32 requests share a 512-token system prompt; those admitted once its blocks are written (all but the
    # first two steps' 14 or so) take its 32 blocks from the cache
    assert ours["cached_prompt_tokens"] >= 16 * 512
    assert ours["prompt_tokens"] == off["prompt_tokens"]
    # the machine's ceilings, measured once, and each run's shares of them
    assert result["ceilings"]["fma_gflop_per_s"] > 0 and result["ceilings"]["read_gb_per_s"] > 0
    for figures in (ours, off):
        assert figures["prompt_fma_share"] > 0 and figures["decode_read_share"] > 0
    assert "share of the FMA peak" in out.stdout


def test_long_shared_prefix_after_a_cold_restart_comes_from_the_tier(tmp_path, tokenizer):
    """A warm-up pass, a restarted stack, the measured pass on the warm-up's cache salt: the first request
    loads the system prompt from the RocksDB tier (the pool is new), the later ones find it in the pool. The
    tier's temporary directory is removed afterwards."""
    model = save_tiny_llama(tmp_path / "tiny", max_position_embeddings=4096)
    tokenizer.save_pretrained(model)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    out = subprocess.run(
        [*PAGEDSERVE, "bench", "--workload", "long-shared-prefix", "--model", str(model), "--dtype",
         "float32", "--no-peers", "--kv-tier", "rocksdb", "--cold-restart",
         "--json", str(tmp_path / "bench.json")],
        capture_output=True, text=True, timeout=600, env={**os.environ, "TMPDIR": str(scratch)},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "prompt blocks from the KV tier" in out.stdout
    result = json.loads((tmp_path / "bench.json").read_text())
    assert "KV tier rocksdb, cold restarts" in result["setup"]
    ours = result["pagedserve"]
    assert ours["requests"] == 16 and ours["generated_tokens"] == 16 * 16
    assert ours["ttft_p99_ms"] >= ours["ttft_p50_ms"] > 0
    # the whole system prompt (248 blocks of 16) from the tier; counted as cached tokens too
    assert ours["tier_hit_blocks"] >= LONG_PREFIX_TOKENS // 16
    assert ours["tier_load_ms_per_block"] > 0
    assert ours["cached_prompt_tokens"] >= LONG_PREFIX_TOKENS
    assert not list(scratch.glob("pagedserve-bench-tier-*"))


@pytest.mark.parametrize("shape", ["tiny-llama", "tiny-qwen2"])
def test_bench_at_a_model_shape_builds_it_and_dates_the_result(shape, tmp_path):
    """The bench builds the shape's random-weight model in the cache and serves it; the JSON names the
    shape, the date and the machine (common.cpu.describe())."""
    out = subprocess.run(
        [*PAGEDSERVE, "bench", "--workload", "latency", "--model-shape", shape, "--dtype", "float32",
         "--no-peers", "--json", str(tmp_path / "bench.json")],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "PAGEDSERVE_CACHE_DIR": str(tmp_path)},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["model_shape"] == shape and f"(model shape {shape}, random weights)" in result["setup"]
    assert result["setup"].startswith(f"{shape}-random-") and list((tmp_path / "models").glob(f"{shape}-*"))
    assert result["machine"] == describe() and result["date"].startswith(str(datetime.now(UTC).date()))
    assert f"measured {result['date']} on {result['machine']}" in out.stdout
    assert result["pagedserve"]["generated_tokens"] == 128 and result["pagedserve"]["prompt_tokens"] == 256


def test_bench_with_drafts_reports_the_share_kept(tmp_path):
    """--draft-tokens reaches the stack the bench starts, and the JSON and table hold the share of the drafts
    compute fed that its steps kept (the latency prompt is random ids, after which the model repeats
    itself)."""
    out = subprocess.run(
        [*PAGEDSERVE, "bench", "--workload", "latency", "--dtype", "float32", "--no-peers", "--draft-tokens",
         "4", "--json", str(tmp_path / "bench.json")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert "--draft-tokens 4" in result["setup"]
    assert 0.5 < result["pagedserve"]["drafts_kept"] <= 1
    assert "prompt-lookup drafts kept" in out.stdout


def test_bench_peer_llamacpp_sends_the_same_token_ids(stack_fp32, tmp_path):
    """The llama.cpp peer on the default model's GGUF, against a server that speaks llama-server's protocol
    (tests/llamacpp_protocol_server.py): it gets the workload's token ids, and its figures, settings and
    setup go into the table and the JSON beside pagedserve's."""
    record = tmp_path / "requests.jsonl"
    out = subprocess.run(
        [*PAGEDSERVE, "bench", "--workload", "latency", "--no-peers", "--target", stack_fp32.target,
         "--cache-target", stack_fp32.cache_target, "--peer", "llamacpp", "--llamacpp-threads", "2",
         "--llamacpp-server", str(llamacpp_protocol_server.install(tmp_path)),
         "--json", str(tmp_path / "bench.json")],
        capture_output=True, text=True, timeout=600, env={**os.environ, "LLAMACPP_TEST_RECORD": str(record)},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    ours, theirs = result["pagedserve"], result["peers"]["llama.cpp"]
    assert theirs["generated_tokens"] == ours["generated_tokens"] == 128
    assert theirs["prompt_tokens"] == ours["prompt_tokens"] == 256 and theirs["itl_p50_ms"] > 0
    settings = result["peer_settings"]["llama.cpp"]
    assert settings["gguf"].endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and settings["threads"] == 2
    assert settings["parallel"] == 1 and settings["version"] == "version: 1 (protocol test server)"
    assert (
        result["llamacpp_setup"].startswith("llama.cpp version: 1")
        and "2 threads" in result["llamacpp_setup"]
    )
    assert "(llama.cpp version: 1" in out.stdout and "vs llama.cpp" in out.stdout
    prompt = build("latency", 49152).requests[0].prompt_ids
    sent = [json.loads(line)["body"] for line in record.read_text().splitlines()]
    assert sent[-1]["prompt"] == prompt and sent[-1]["max_tokens"] == 128, "the bench's own token ids"
