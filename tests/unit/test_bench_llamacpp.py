"""The llama.cpp peer against a real HTTP server that speaks llama-server's protocol
(tests/llamacpp_protocol_server.py), started by the peer as it starts llama-server: the command line, the
requests, the streamed token counts and the figures, a fresh server each pass, the errors and the flags."""

import argparse
import json
import re
from pathlib import Path

import pytest

from cli.bench import command, driver, llamacpp_client, llamacpp_peer, report
from cli.bench.workloads import BenchRequest, Workload
from tests import llamacpp_protocol_server

NEW_TOKENS = 9
# SmolLM2-135M's shape: 30 layers, 3 KV heads of 64; float16 K/V: 23,040 bytes a token.
CONFIG = {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3}


@pytest.fixture
def binary(tmp_path: Path) -> Path:
    return llamacpp_protocol_server.install(tmp_path)


@pytest.fixture
def model(tmp_path: Path) -> str:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(CONFIG))
    return str(tmp_path / "model")


@pytest.fixture
def record(tmp_path: Path, monkeypatch) -> Path:
    path = tmp_path / "requests.jsonl"
    monkeypatch.setenv("LLAMACPP_TEST_RECORD", str(path))
    return path


def _workload() -> Workload:
    """Three requests on one 40-token system prompt, 0.1 s apart."""
    system = list(range(500, 540))
    return Workload("tiny", "tiny", [BenchRequest([*system, 1000 + i, 2000 + i], NEW_TOKENS, 0.1 * i)
                                     for i in range(3)])  # fmt: skip


def test_the_server_gets_the_gguf_threads_slots_and_a_unified_kv_of_the_default_pool(model):
    settings = llamacpp_peer.server_settings(_workload(), model, threads=2)
    assert settings["ctx_size"] == 256 * 2**20 // 23_040, "the cache service's default pool, float16 K/V"
    assert settings["parallel"] == 3 and settings["kv_unified"] and settings["threads"] == 2
    assert llamacpp_peer.server_settings(Workload("m", "m", _workload().requests, kv_tokens=100), model,
                                         threads=1)["parallel"] == 1, "100 tokens hold one of 51"  # fmt: skip
    with pytest.raises(ValueError, match="KV of 40 tokens cannot hold a sequence of 51"):
        llamacpp_peer.server_settings(Workload("m", "m", _workload().requests, kv_tokens=40), model, 1)
    argv = llamacpp_peer.argv("/bin/llama-server", settings, 48000)
    assert argv[:7] == ["/bin/llama-server", "--model", model, "--host", "127.0.0.1", "--port", "48000"]
    assert " ".join(argv[7:]).startswith("--threads 2 --threads-batch 2 --parallel 3 --ctx-size 11650")
    assert "--kv-unified" in argv and argv[-1] == "--no-repack", "ggml's AMX kernels stop on Q4_1 here"
    repacked = llamacpp_peer.server_settings(_workload(), model, threads=2, repack=True)
    assert "--no-repack" not in llamacpp_peer.argv("/bin/llama-server", repacked, 48000)


def test_every_request_goes_greedy_as_token_ids_with_timings_per_token():
    body = llamacpp_client.body(BenchRequest([7, 8, 9], 5))
    assert body["prompt"] == [7, 8, 9] and body["max_tokens"] == 5 and body["temperature"] == 0.0
    assert body["ignore_eos"] and body["stream"] and body["timings_per_token"]
    assert body["stream_options"] == {"include_usage": True}


def test_each_pass_runs_on_a_fresh_server_and_every_token_is_timed(binary, model, record):
    workload = _workload()
    settings = {"version": "v", **llamacpp_peer.server_settings(workload, model, threads=2)}
    counted = []
    figures = llamacpp_peer.measure(str(binary), workload, settings, repeat=2, on_token=counted.append)

    assert sum(counted) == 2 * 3 * NEW_TOKENS, "held-back tokens are counted with the next chunk"
    assert figures["generated_tokens"] == 3 * NEW_TOKENS and figures["prompt_tokens"] == 3 * 42
    # the first request of a pass computes the system prompt; the later two find it (40 tokens each)
    assert figures["cached_prompt_tokens"] == 2 * 40, "a fresh server each pass: the first finds nothing"
    assert figures["itl_p50_ms"] >= 15, "a token every 20 ms, seen as it streams (not buffered)"
    assert figures["wall_s"] >= 0.2 + NEW_TOKENS * 0.02, "the last request arrives 0.2 s in"
    assert all(figures[key] is None for key in driver.CACHE_ONLY)

    sent = [json.loads(line) for line in record.read_text().splitlines()]
    assert len({entry["port"] for entry in sent}) == 2, "one server per pass"
    assert len(sent) == 2 * 4, "a warm-up request and the workload's three, per pass"
    warm, *measured = sent[:4]
    assert warm["body"]["prompt"][0] not in {r.prompt_ids[0] for r in workload.requests}, "shares no prefix"
    assert sorted(e["body"]["prompt"] for e in measured) == [r.prompt_ids for r in workload.requests]
    argv = warm["argv"]
    assert argv[argv.index("--threads") + 1] == "2" and argv[argv.index("--parallel") + 1] == "3"
    assert llamacpp_peer.version(str(binary)) == "version: 1 (protocol test server)"


def test_a_server_that_exits_at_start_is_an_error_with_its_log(binary, model, monkeypatch):
    monkeypatch.setenv("LLAMACPP_TEST_EXIT", "3")
    settings = llamacpp_peer.server_settings(_workload(), model, threads=1)
    with pytest.raises(RuntimeError, match="llama-server exited with 3:\nerror: failed to load model"):
        llamacpp_peer.measure(str(binary), _workload(), settings, repeat=1)


def test_a_stream_broken_off_is_an_error_with_the_servers_message(binary, model, monkeypatch):
    monkeypatch.setenv("LLAMACPP_TEST_FAIL_AFTER", "6")
    settings = llamacpp_peer.server_settings(_workload(), model, threads=1)
    with pytest.raises(llamacpp_client.ServerError, match="broke off the stream: .*decode failed"):
        llamacpp_peer.measure(str(binary), _workload(), settings, repeat=1)


def test_a_short_answer_is_an_error():
    trace = driver.Trace(sent=0.0, token_times=[1.0, 1.1], prompt_tokens=4, completion_tokens=2)
    with pytest.raises(ValueError, match="llama.cpp request 0: 2 tokens, 2 times, max_tokens 3"):
        driver.check_complete(llamacpp_peer.NAME, Workload("w", "w", [BenchRequest([1] * 4, 3)]), [trace])


def _bench(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    command.add_parser(parser.add_subparsers())
    return parser.parse_args(["bench", "--workload", "latency", *argv])


def test_peer_llamacpp_needs_a_binary_and_a_gguf(binary, model, monkeypatch, tmp_path):
    monkeypatch.delenv(llamacpp_peer.SERVER_ENV, raising=False)
    with pytest.raises(SystemExit, match="--peer llamacpp needs --llamacpp-server PATH"):
        command.run(_bench("--peer", "llamacpp"))
    with pytest.raises(SystemExit, match="no such executable"):
        command.run(_bench("--peer", "llamacpp", "--llamacpp-server", str(tmp_path / "none")))
    with pytest.raises(SystemExit, match="--model-shape makes a random-weight Hugging Face model"):
        command.run(
            _bench("--peer", "llamacpp", "--llamacpp-server", str(binary), "--model-shape", "tiny-llama")
        )
    with pytest.raises(SystemExit, match=f"--model {re.escape(model)} is not one"):
        command.run(_bench("--peer", "llamacpp", "--llamacpp-server", str(binary), "--model", model))
    monkeypatch.setenv(llamacpp_peer.SERVER_ENV, str(binary))
    args = _bench("--peer", "llamacpp", "--model", str(tmp_path / "m.gguf"))
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    llamacpp_peer.check_flags(args)
    assert args.llamacpp_server == str(binary), "the variable when no flag"
    assert args.llamacpp_threads >= 1, "every CPU the bench may use"


def test_the_llamacpp_column_comes_after_vllm_and_its_setup_under_the_title():
    result = {
        "workload": "latency", "description": "d", "setup": "s", "date": "2026-12-03T10:00:00+00:00",
        "machine": "Example Xeon, 2 CPUs, AMX", "vllm_setup": "vLLM 0.32.0", "llamacpp_setup": "llama.cpp v",
        "pagedserve": {"itl_p50_ms": 16.0},
        "peers": {"generate": {}, "llama.cpp": {"itl_p50_ms": 20.0}, "vLLM": {"itl_p50_ms": 40.0}},
    }  # fmt: skip
    lines = report.table(result).splitlines()
    assert lines[1] == "(measured 2026-12-03T10:00:00+00:00 on Example Xeon, 2 CPUs, AMX)"
    assert lines[2:5] == ["(s)", "(vLLM 0.32.0)", "(llama.cpp v)"]
    assert lines[5].split()[:4] == ["metric", "pagedserve", "vLLM", "llama.cpp"]
    itl = next(line for line in lines if line.startswith("inter-token p50"))
    assert itl.split()[-4:-2] == ["2.50x", "1.25x"]
