"""A bench run's figures against the machine's ceilings (cli/bench/roofline.py): the model's FLOPs and bytes
counted from its config, the shares they make of measured ceilings, and the ceilings measured for real by
the native kernels."""

import json

import pytest

from cli.bench import ceilings, driver, report, roofline
from cli.bench.workloads import BenchRequest, Workload
from common.model_files import local_copy

SMOLLM2 = json.loads((local_copy("smollm2").path / "config.json").read_text())


def test_smollm2_costs_212_mflop_a_prompt_token_and_reads_its_135m_weights_a_decode_step():
    cost = roofline.ModelCost.from_config(SMOLLM2)
    assert cost.layer_weights == 30 * (576 * 64 * (2 * 9 + 2 * 3) + 3 * 576 * 1536)
    assert cost.head_weights == 49152 * 576
    assert cost.prompt_flops(1, 0) / 1e6 == pytest.approx(212.3, abs=0.1)
    assert cost.prompt_flops(0, 1) == 4 * 64 * 9 * 30, "a key costs its scores and its weighted sum"
    weights = (cost.layer_weights + cost.head_weights) * 4
    kv_token = 2 * 30 * 3 * 64 * 4
    assert cost.decode_bytes("float32", "float32", 100, 2) == weights + kv_token * 200
    assert cost.decode_bytes("int8", "bfloat16", 0, 1) == weights / 4


def test_a_model_of_experts_or_of_no_known_shape_gets_no_cost():
    assert roofline.ModelCost.from_config({**SMOLLM2, "num_local_experts": 8}) is None
    assert roofline.ModelCost.from_config({"model_type": "bert"}) is None
    assert roofline.ModelCost.from_config({"text_config": SMOLLM2}) == roofline.ModelCost.from_config(SMOLLM2)


def test_shares_are_the_figures_over_the_ceilings():
    cost = roofline.ModelCost(
        layer_weights=1000, head_weights=500, layers=2, q_heads=4, kv_heads=2, head_dim=8
    )
    workload = Workload("w", "", [BenchRequest([1] * 90, 20, 0.0), BenchRequest([1] * 10, 20, 0.0)])
    figures = {
        "prompt_tokens": 100, "cached_prompt_tokens": 20, "prompt_tokens_per_s": 40.0,
        "prompt_attention_keys": 3000, "itl_p50_ms": 50.0, "generated_tokens_per_s": 80.0,
    }  # fmt: skip
    top = {"fma_gflop_per_s": 1e-3, "read_gb_per_s": 1e-3}
    shares = roofline.shares(figures, cost, top, workload, "float32", "float32")
    flops = 2 * 1000 * 80 + 4 * 8 * 4 * 2 * 3000  # 80 tokens computed in 2 s
    assert shares["prompt_gflop_per_s"] == pytest.approx(flops / 2 / 1e9)
    assert shares["prompt_fma_share"] == pytest.approx(flops / 2 / 1e9 / 1e-3)
    streams, context = 80 * 0.05, (90 + 10 + 20) / 2  # 4 streams in flight; 60 tokens of context each
    step_bytes = 1500 * 4 + 2 * 2 * 2 * 8 * 4 * context * streams
    assert shares["decode_gb_per_s"] == pytest.approx(step_bytes / 0.05 / 1e9)
    assert roofline.shares({}, cost, top, workload, "float32", "float32") == dict.fromkeys(shares)


def test_the_attention_keys_of_a_run_count_only_the_computed_prompt_tokens():
    traces = [driver.Trace(0.0, [1.0, 1.1], 10, 4, 2), driver.Trace(0.0, [2.0, 2.5], 3, 0, 2)]
    assert driver.timings(traces)["prompt_attention_keys"] == (55 - 10) + 6


def test_shares_beat_a_peer_when_larger_and_the_table_names_the_ceilings():
    assert report.ratio(0.5, 0.25, "prompt_fma_share") == 2.0
    result = {
        "workload": "w", "description": "d", "date": "2026-12-07", "machine": "m",
        "ceilings": {"fma_gflop_per_s": 150.0, "read_gb_per_s": 12.5, "threads": 2},
        "pagedserve": {"prompt_gflop_per_s": 75.0, "prompt_fma_share": 0.5},
    }  # fmt: skip
    table = report.table(result)
    assert "ceilings: 150 GFLOP/s float32 FMA, 12.5 GB/s read, 2 threads" in table
    assert "share of the FMA peak" in table and "50%" in table


def test_the_native_kernels_measure_this_machines_ceilings():
    measured = ceilings.measure()
    assert measured["fma_gflop_per_s"] > 1 and measured["read_gb_per_s"] > 0.1
    assert measured["threads"] >= 1 and measured["machine"]
