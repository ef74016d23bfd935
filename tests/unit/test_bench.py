import time

import pytest
from prometheus_client import REGISTRY, generate_latest

from cli.bench import driver, profile, report
from cli.bench.workloads import WORKLOADS, build
from cli.scrape import parse
from gateway.step_timer import StepTimer
from protos import compute_pb2


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
    assert set(WORKLOADS) == {"throughput", "mixed", "latency", "shared-prefix", "memory"}


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
