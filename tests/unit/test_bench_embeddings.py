"""The embeddings workload's inputs, figures and table (cli/bench/embeddings.py), and its vLLM driver's
workload checks (run without vLLM)."""

import json

import pytest

from cli.bench import embeddings, vllm_embed_driver


def test_batches_are_deterministic_and_of_their_shape():
    first = embeddings.batches(3, 1000)
    assert first == embeddings.batches(3, 1000) and first != embeddings.batches(4, 1000)
    assert len(first) == embeddings.BATCHES and all(len(batch) == embeddings.BATCH for batch in first)
    lengths = [len(ids) for batch in first for ids in batch]
    assert min(lengths) >= embeddings.MIN_TOKENS and max(lengths) <= embeddings.MAX_TOKENS
    assert all(100 <= token < 1000 for batch in first for ids in batch for token in ids)


def test_figures_count_inputs_and_tokens_over_the_batches_time():
    inputs = [[[1] * 10, [1] * 30], [[1] * 20, [1] * 40]]
    figures = embeddings.figures([0.5, 1.5], inputs)
    assert figures["embeddings_per_s"] == pytest.approx(2.0) and figures["prompt_tokens_per_s"] == 50
    assert figures["batch_ms_p50"] == pytest.approx(1000) and figures["batch_ms_p99"] == pytest.approx(1500)
    median = embeddings.median_of([figures, {**figures, "embeddings_per_s": 4.0}, figures])
    assert median["embeddings_per_s"] == pytest.approx(2.0)


def test_the_table_shows_every_column_and_the_ratio():
    ours = {"embeddings_per_s": 100.0, "batch_ms_p50": 320.0}
    result = {
        "workload": "embeddings", "description": "d", "setup": "s", "pagedserve": ours,
        "peers": {"vLLM": {"embeddings_per_s": 50.0, "batch_ms_p50": 640.0}},
        "ratios": {"embeddings_per_s": 2.0, "batch_ms_p50": 2.0},
    }  # fmt: skip
    lines = embeddings.table(result).splitlines()
    assert lines[2].split() == ["figure", "pagedserve", "vLLM", "ratio"]
    assert lines[3].split() == ["embeddings_per_s", "100.00", "50.00", "2.00"]


def test_a_plain_decoder_is_benched_pooled_by_its_last_token(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert embeddings.stack_flags(str(tmp_path)) == ("--pooling", "last")
    (tmp_path / "modules.json").write_text("[]")
    assert embeddings.stack_flags(str(tmp_path)) == ()


def test_the_vllm_driver_refuses_a_workload_it_cannot_run():
    good = {"protocol": 1, "model": "m", "dtype": "float32", "max_model_len": 8, "kv_memory_bytes": 1,
            "passes": [[[[1, 2]]]]}  # fmt: skip
    assert vllm_embed_driver.read_workload(json.dumps(good))["passes"] == good["passes"]
    for bad, says in (({**good, "protocol": 2}, "protocol"), ({**good, "passes": []}, "empty pass")):
        with pytest.raises(ValueError, match=says):
            vllm_embed_driver.read_workload(json.dumps(bad))


def test_vllm_is_asked_for_the_longest_input_as_its_length(tmp_path):
    from cli.bench import vllm_embed_peer

    passes = [[[[1] * 40, [1] * 7]], [[[1] * 90]]]
    request = vllm_embed_peer.request_json(tmp_path, "float32", 2**20, passes)
    assert request["max_model_len"] == 90 and request["passes"] == passes
    assert vllm_embed_driver.read_workload(json.dumps(request))["model"] == str(tmp_path)
