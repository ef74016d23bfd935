from gateway.bench import driver, report
from gateway.bench.workloads import WORKLOADS, build


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
    assert set(WORKLOADS) == {"throughput", "mixed", "latency", "shared-prefix", "memory"}


def test_summary_times_what_the_client_saw():
    traces = [
        driver.Trace(sent=0.0, token_times=[1.0, 1.5, 2.0], prompt_tokens=10, completion_tokens=3),
        driver.Trace(
            sent=0.5, token_times=[1.0, 3.0], prompt_tokens=20, cached_tokens=16, completion_tokens=2
        ),
    ]
    summary = driver.summarize(traces, [driver.CacheSample(3, 2), driver.CacheSample(5, 1)])
    assert summary["wall_s"] == 3.0
    assert summary["tokens_per_s"] == 35 / 3.0
    assert summary["prompt_tokens_per_s"] == (30 - 16) / 1.0
    assert summary["ttft_p50_ms"] in (500.0, 1000.0)
    assert summary["itl_p99_ms"] == 2000.0
    assert summary["peak_used_blocks"] == 5 and summary["peak_sequences"] == 2


def test_ratios_favour_pagedserve_above_one():
    result = {
        "workload": "w", "description": "d", "setup": "s",
        "pagedserve": {"tokens_per_s": 300.0, "itl_p50_ms": 10.0},
        "peers": {"generate_batch": {"tokens_per_s": 100.0, "itl_p50_ms": 20.0}, "generate": {}},
    }  # fmt: skip
    text = report.table(result)
    assert "3.00x" in text, "tokens/s: higher is better"
    assert "2.00x" in text, "latency: lower is better"
