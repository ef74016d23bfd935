"""`pagedserve bench-plot`: the series it draws from bench JSON files, and a reproducible PNG."""

import json

import pytest

from cli.bench import plot


def _result(workload: str, ours: dict, **peers: dict) -> dict:
    return {"workload": workload, "description": "d", "setup": "s", "pagedserve": ours, "peers": peers}


def test_the_plot_has_every_engine_per_workload_in_the_bench_order():
    results = [
        _result("latency", {"tokens_per_s": 30.0, "itl_p50_ms": 100.0}, vLLM={"itl_p50_ms": 95.0}),
        _result(
            "throughput", {"tokens_per_s": 144.0}, vLLM={"tokens_per_s": 159.0}, generate={"tokens_per_s": 1}
        ),
    ]
    names, values = plot.series(results)
    assert names == ["throughput", "latency"], "the order of WORKLOADS"
    assert values["tokens_per_s"]["pagedserve"] == [144.0, 30.0]
    assert values["tokens_per_s"]["vLLM"] == [159.0, None]
    assert values["tokens_per_s"]["generate"] == [1, None]
    assert values["itl_p50_ms"]["vLLM"] == [None, 95.0] and values["itl_p50_ms"]["generate_batch"] == [
        None,
        None,
    ]
    with pytest.raises(ValueError, match="two results for workload 'latency'"):
        plot.series([results[0], results[0]])


def test_bench_plot_writes_the_same_png_from_the_same_files(tmp_path):
    source = tmp_path / "latency.json"
    source.write_text(json.dumps(_result("latency", {"tokens_per_s": 30.0, "itl_p50_ms": 100.0})))
    first, second = tmp_path / "a.png", tmp_path / "b" / "b.png"
    assert plot.main([str(source), "--output", str(first)]) == 0
    assert plot.main([str(source), "--output", str(second)]) == 0
    assert first.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and first.stat().st_size > 10_000
    assert first.read_bytes() == second.read_bytes(), "reproducible: no date or version inside"
    with pytest.raises(SystemExit, match="bench-plot: .*missing.json"):
        plot.main([str(tmp_path / "missing.json")])
