import argparse
import time

import pytest
from prometheus_client import REGISTRY, generate_latest

from cli.bench import command, driver, profile, report
from cli.bench.workloads import LONG_PREFIX_TOKENS, WORKLOADS, build
from cli.scrape import parse
from gateway.step_timer import StepTimer
from protos import cache_pb2, compute_pb2


def test_workloads_have_the_documented_shapes():
    throughput = build("throughput", 49152)
    assert len(throughput.requests) == 16
    assert {len(r.prompt_ids) for r in throughput.requests} == {256}
    assert {r.max_tokens for r in throughput.requests} == {64}
    mixed = build("mixed", 49152)
    assert len(mixed.requests) == 48
    assert all(16 <= len(r.prompt_ids) <= 1024 and 16 <= r.max_tokens <= 128 for r in mixed.requests)
    arrivals = [r.arrival_s for r in mixed.requests]
    assert arrivals == sorted(arrivals) and arrivals[-1] > 0
    shared = build("shared-prefix", 49152)
    prefix = shared.requests[0].prompt_ids[:512]
    assert all(r.prompt_ids[:512] == prefix and 528 <= len(r.prompt_ids) <= 576 for r in shared.requests)
    assert build("latency", 49152, seed=3) == build("latency", 49152, seed=3), "deterministic"
    memory = build("memory", 49152)
    assert memory.stack_flags(16) == ("--kv-blocks", "256") and memory.stack_flags(128) == (
        "--kv-blocks",
        "32",
    )
    assert throughput.stack_flags(16) == ()
    assert set(WORKLOADS) == {
        "throughput", "mixed", "latency", "shared-prefix", "memory", "long-shared-prefix"
    }  # fmt: skip


def test_long_shared_prefix_is_one_long_system_prompt_then_short_unique_suffixes_over_time():
    workload = build("long-shared-prefix", 49152, seed=7)
    requests = workload.requests
    assert len(requests) == 16 and LONG_PREFIX_TOKENS == 3968
    prefix = requests[0].prompt_ids[:LONG_PREFIX_TOKENS]
    assert all(r.prompt_ids[:LONG_PREFIX_TOKENS] == prefix for r in requests)
    suffixes = [tuple(r.prompt_ids[LONG_PREFIX_TOKENS:]) for r in requests]
    assert all(16 <= len(s) <= 32 for s in suffixes) and len(set(suffixes)) == 16, "distinct user turns"
    assert all(100 <= t < 49152 for r in requests for t in r.prompt_ids), "no special tokens"
    assert {r.max_tokens for r in requests} == {16}
    # within SmolLM2's 8,192 positions and one 4,096-token prompt chunk; whole blocks at sizes 16-128
    assert max(len(r.prompt_ids) + r.max_tokens for r in requests) <= 4096
    assert all(LONG_PREFIX_TOKENS % size == 0 for size in (16, 32, 64, 128))
    arrivals = [r.arrival_s for r in requests]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals) and len(set(arrivals)) == 16
    assert 1.0 < arrivals[-1] < 15.0, "Poisson at 4/s: 15 gaps of 0.25 s on average"
    assert workload == build("long-shared-prefix", 49152, seed=7), "deterministic"
    assert build("long-shared-prefix", 49152, seed=8).requests[0].prompt_ids[:8] != prefix[:8]
    assert workload.stack_flags(16) == () and not workload.prefix_cache_off_peer, "the default pool"
    # the most it holds at once fits the default 256MiB pool at float32 SmolLM2-135M (46,080 bytes/token)
    blocks = LONG_PREFIX_TOKENS // 16 + sum(-(-(len(s) + 16) // 16) for s in suffixes)
    assert blocks * 16 * 46_080 <= 256 * 2**20


def _bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    command.add_parser(parser.add_subparsers())
    return parser.parse_args(["bench", "--workload", "long-shared-prefix", *argv])


def test_the_bench_forwards_only_the_tier_flags_given_to_the_stacks_it_starts():
    assert command.TIER.command_line(_bench_args()) == []
    args = _bench_args("--kv-tier", "rocksdb", "--kv-tier-path", "/tmp/t", "--kv-tier-hot", "0")
    assert command.TIER.command_line(args) == ["--kv-tier", "rocksdb", "--kv-tier-path", "/tmp/t",
                                               "--kv-tier-hot", "0.0"]  # fmt: skip
    assert command._tier_label(args) == "KV tier rocksdb"
    assert command._tier_label(_bench_args("--kv-tier", "none")) == "no KV tier"


def test_the_bench_forwards_the_step_sizing_flags_given_and_names_them():
    assert command.STEP_SIZING.command_line(_bench_args()) == []
    args = _bench_args("--decode-step-target-ms", "0", "--prefill-tokens-with-decodes", "256")
    assert command.STEP_SIZING.command_line(args) == ["--prefill-tokens-with-decodes", "256",
                                                      "--decode-step-target-ms", "0.0"]  # fmt: skip
    assert command._sizing_label(args) == ", --prefill-tokens-with-decodes 256 --decode-step-target-ms 0.0"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--target", "127.0.0.1:1", "--cold-restart"], "--cold-restart applies to a stack the bench starts"),
        (["--target", "127.0.0.1:1", "--kv-tier", "rocksdb"], "--kv-tier/--config applies to a stack"),
        (["--cold-restart", "--profile"], "--profile reads one stack's metrics"),
        (["--kv-tier", "redis"], "--kv-tier redis needs --kv-tier-path redis://"),
        (["--target", "127.0.0.1:1", "--model-shape", "tiny-llama"], "--model-shape applies to a stack the"),
        (["--model-shape", "tiny-llama", "--model", "/m"], "--model-shape makes the model; drop --model"),
    ],
)
def test_the_bench_refuses_flags_that_do_not_go_together(argv, message):
    with pytest.raises(SystemExit, match=message):
        command.run(_bench_args(*argv))


def test_summary_times_what_the_client_saw():
    traces = [
        driver.Trace(sent=0.0, token_times=[1.0, 1.5, 2.0], prompt_tokens=10, completion_tokens=3),
        driver.Trace(
            sent=0.5, token_times=[1.0, 3.0], prompt_tokens=20, cached_tokens=16, completion_tokens=2
        ),
    ]
    samples = [driver.CacheSample(3, 2, 40, 48, 0.0), driver.CacheSample(5, 1, 70, 80, 0.1)]
    summary = driver.summarize(traces, samples)
    assert summary["wall_s"] == 3.0
    assert summary["tokens_per_s"] == 35 / 3.0
    assert summary["prompt_tokens_per_s"] == (30 - 16) / 1.0
    assert summary["ttft_p50_ms"] in (500.0, 1000.0)
    assert summary["itl_p99_ms"] == 2000.0
    assert summary["peak_used_blocks"] == 5 and summary["peak_sequences"] == 2


def test_tier_loads_are_the_difference_of_two_stats_and_none_without_a_tier():
    def stats(hits: int, seconds: float) -> cache_pb2.CacheStats:
        return cache_pb2.CacheStats(kv_tier=cache_pb2.TierStats(hit_blocks=hits, load_seconds=seconds))

    assert driver.tier_loads(stats(10, 0.5), stats(110, 0.7)) == {
        "tier_hit_blocks": 100,
        "tier_load_ms_per_block": pytest.approx(2.0),
    }
    assert driver.tier_loads(stats(10, 0.5), stats(10, 0.5)) == {
        "tier_hit_blocks": 0,
        "tier_load_ms_per_block": None,
    }
    none = cache_pb2.CacheStats()
    assert driver.tier_loads(none, none) == {"tier_hit_blocks": None, "tier_load_ms_per_block": None}


def test_kv_utilisation_is_weighted_by_time_and_read_at_peak_occupancy():
    samples = [
        driver.CacheSample(0, 0, 0, 0, 0.0),  # nothing held yet: left out
        driver.CacheSample(2, 1, 24, 32, 1.0),  # 75 % for 3 s
        driver.CacheSample(4, 2, 60, 64, 4.0),  # 93.75 % for 1 s, the peak
        driver.CacheSample(1, 1, 16, 16, 5.0),  # 100 % for 1 s
        driver.CacheSample(0, 0, 0, 0, 6.0),
    ]
    figures = driver.kv_utilisation(samples)
    assert figures["kv_utilisation_mean"] == pytest.approx((0.75 * 3 + 0.9375 + 1.0) / 5)
    assert figures["kv_utilisation_at_peak"] == 0.9375
    assert driver.kv_utilisation(samples[:1]) == {"kv_utilisation_mean": None, "kv_utilisation_at_peak": None}
    runs = [{"kv_utilisation_mean": None, "x": 1.0}, {"kv_utilisation_mean": 0.5, "x": 3.0}]
    assert driver.median_of(runs) == {"kv_utilisation_mean": 0.5, "x": 2.0}


def test_ratios_favour_pagedserve_above_one():
    result = {
        "workload": "w", "description": "d", "setup": "s",
        "pagedserve": {"tokens_per_s": 300.0, "itl_p50_ms": 10.0},
        "peers": {"generate_batch": {"tokens_per_s": 100.0, "itl_p50_ms": 20.0}, "generate": {}},
    }  # fmt: skip
    text = report.table(result)
    assert "3.00x" in text, "tokens/s: higher is better"
    assert "2.00x" in text, "latency: lower is better"


def test_the_prefix_cache_off_run_gets_its_own_column_and_ratio():
    result = {
        "workload": "w", "description": "d", "setup": "s",
        "pagedserve": {"tokens_per_s": 400.0, "cached_prompt_tokens": 9000.0},
        "peers": {report.PREFIX_CACHE_OFF: {"tokens_per_s": 100.0, "cached_prompt_tokens": 0.0}},
    }  # fmt: skip
    lines = report.table(result).splitlines()
    assert lines[2].rstrip().endswith("vs prefix cache off")
    tokens_per_s = next(line for line in lines if line.startswith("tokens/s"))
    assert tokens_per_s.split()[-1] == "4.00x"
    assert [p for p in WORKLOADS if build(p, 1000).prefix_cache_off_peer] == ["shared-prefix"]


def test_profile_reads_the_step_histograms_between_two_scrapes():
    before = profile.totals(parse(generate_latest(REGISTRY).decode()))
    for _ in range(2):
        timer = StepTimer()
        with timer.phase("cache_rpc"):
            time.sleep(0.002)
        with timer.phase("compute_rpc"):
            time.sleep(0.02)
        timer.compute = compute_pb2.ForwardResponse(
            forward_ms=19.0, prepare_ms=1.0, model_ms=15.0, attention_ms=4.0, sample_ms=2.0
        )
        timer.finish("decode")
    summary = profile.summarize(before, profile.totals(parse(generate_latest(REGISTRY).decode())))
    assert set(summary) == {"decode"}, "no prefill step ran between the scrapes"
    decode = summary["decode"]
    assert decode["steps"] == 2
    phases = decode["phases_ms"]
    assert phases["compute_model"] == pytest.approx(15.0) and phases["compute_sample"] == pytest.approx(2.0)
    assert phases["compute_attention"] == pytest.approx(4.0) and phases["compute_prepare"] == pytest.approx(
        1.0
    )
    assert phases["cache_rpc"] >= 2.0 and phases["compute_rpc"] >= 20.0
    assert decode["step_ms"] >= phases["cache_rpc"] + phases["compute_rpc"] + phases["schedule"]
    assert decode["overhead_ms"] == pytest.approx(decode["step_ms"] - 17.0)
    assert decode["overhead_pct"] == pytest.approx(100 * decode["overhead_ms"] / decode["step_ms"])
    text = profile.table(summary)
    assert "orchestration overhead" in text and "compute_attention" in text


def test_profile_parses_prometheus_text():
    text = """# TYPE pagedserve_step_duration_seconds histogram
pagedserve_step_duration_seconds_count{kind="prefill"} 4.0
pagedserve_step_duration_seconds_sum{kind="prefill"} 2.0
# TYPE pagedserve_step_phase_seconds histogram
pagedserve_step_phase_seconds_count{kind="prefill",phase="compute_model"} 4.0
pagedserve_step_phase_seconds_sum{kind="prefill",phase="compute_model"} 1.5
# TYPE pagedserve_ttft_seconds histogram
pagedserve_ttft_seconds_count 9.0
"""
    totals = profile.totals(parse(text))
    assert totals == {("prefill", "step"): (2.0, 4.0), ("prefill", "compute_model"): (1.5, 4.0)}
    summary = profile.summarize({}, totals)["prefill"]
    assert summary["step_ms"] == 500.0 and summary["phases_ms"]["compute_model"] == 375.0
    assert summary["overhead_pct"] == 25.0
