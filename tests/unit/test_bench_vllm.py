"""The vLLM peer without vLLM: the driver's JSON protocol and its streaming loop on a fake engine, the
figures computed from its answer, the ratio table and the flags."""

import argparse
import ast
import asyncio
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from cli.bench import binding, command, driver, engines, report, vllm_driver, vllm_peer
from cli.bench.workloads import BenchRequest, Workload, build


def _workload(*requests: BenchRequest, kv_tokens=None) -> Workload:
    return Workload("tiny", "tiny", list(requests), kv_tokens=kv_tokens)


def _request_json(workload: Workload, **overrides) -> dict:
    request = vllm_peer.request_json(workload, Path("/m"), "float32", 2, kv_memory=2**28)
    return {**request, **overrides}


def test_the_driver_reads_back_what_the_bench_writes_for_every_workload():
    for name in ("throughput", "mixed", "latency", "shared-prefix", "memory", "long-shared-prefix"):
        workload = build(name, 49152)
        read = vllm_driver.read_workload(json.dumps(_request_json(workload)))
        assert [r["prompt_ids"] for r in read["requests"]] == [r.prompt_ids for r in workload.requests]
        assert [r["max_tokens"] for r in read["requests"]] == [r.max_tokens for r in workload.requests]
        assert [r["arrival_s"] for r in read["requests"]] == [r.arrival_s for r in workload.requests]
        longest = max(len(r.prompt_ids) + r.max_tokens for r in workload.requests)
        assert read["max_model_len"] >= longest
        if workload.kv_tokens is None:
            assert read["max_model_len"] >= vllm_peer.MIN_MODEL_LEN
        else:
            assert read["max_model_len"] <= workload.kv_tokens, (
                "one sequence of max_model_len fits the budget"
            )
        assert read["kv_tokens"] == workload.kv_tokens and read["repeat"] == 2


def test_the_engine_gets_the_same_weights_dtype_and_kv_budget(tmp_path):
    args = vllm_driver.engine_args(_request_json(_workload(BenchRequest([5] * 8, 2))))
    assert args["model"] == "/m" and args["dtype"] == "float32" and args["enable_prefix_caching"]
    assert args["kv_cache_memory_bytes"] == 2**28 and "block_size" not in args, "vLLM's own block size"
    assert not args["enforce_eager"], "the bench measures vLLM compiled, as it serves"
    assert args["load_format"] == "auto", "the model directory's weights"
    dummy = vllm_peer.request_json(
        _workload(BenchRequest([5] * 8, 2)), Path("/m"), "float32", 1, dummy_weights=True
    )
    assert vllm_driver.engine_args(dummy)["load_format"] == "dummy", (
        "--model-shape: the config, random weights"
    )
    assert "speculative_config" not in args, "no prompt lookup unless the bench drafts"
    drafting = vllm_peer.request_json(
        _workload(BenchRequest([5] * 8, 2)), Path("/m"), "float32", 1, draft_tokens=4
    )
    assert vllm_driver.engine_args(drafting)["speculative_config"] == {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
    }, "--draft-tokens: vLLM's prompt lookup of as many tokens"  # fmt: skip
    # SmolLM2-135M: 30 layers, 9 query heads of 64 (hidden 576), 3 KV heads: 46,080 bytes a token in float32
    config = {"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert vllm_driver.kv_bytes_per_token(str(tmp_path), "float32") == 46_080
    assert vllm_driver.kv_bytes_per_token(str(tmp_path), "bfloat16") == 23_040
    memory = vllm_driver.engine_args(_request_json(build("memory", 49152), model=str(tmp_path)))
    assert memory["kv_cache_memory_bytes"] == 4096 * 46_080, "the memory of the workload's 4096 tokens"
    assert memory["max_model_len"] <= 4096


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"protocol": 2}, "this driver speaks protocol 1"),
        ({"requests": []}, "no requests"),
        ({"requests": [{"prompt_ids": [1], "max_tokens": 1}]}, "request 0 has no arrival_s"),
        ({"requests": [{"prompt_ids": [], "max_tokens": 1, "arrival_s": 0}]}, "needs a prompt"),
        ({"requests": [{"prompt_ids": [1], "max_tokens": 0, "arrival_s": 0}]}, "max_tokens >= 1"),
    ],
)
def test_the_driver_refuses_a_bad_workload_naming_what_is_wrong(change, message):
    with pytest.raises(ValueError, match=message):
        vllm_driver.read_workload(json.dumps(_request_json(_workload(BenchRequest([5], 1)), **change)))
    text = json.dumps(
        {k: v for k, v in _request_json(_workload(BenchRequest([5], 1))).items() if k != "dtype"}
    )
    with pytest.raises(ValueError, match="no 'dtype'"):
        vllm_driver.read_workload(text)


class FakeEngine:
    """Streams each request's tokens one by one (delta outputs), a token every `step_s`."""

    def __init__(self, step_s: float = 0.01) -> None:
        self.step_s = step_s
        self.prompts: list[dict] = []

    async def generate(self, prompt: dict, params: dict, request_id: str):
        self.prompts.append(prompt)
        ids = prompt["prompt_token_ids"]
        for k in range(params["max_tokens"]):
            await asyncio.sleep(self.step_s)
            last = k == params["max_tokens"] - 1
            yield SimpleNamespace(
                outputs=[SimpleNamespace(token_ids=[ids[0] + k])], finished=last,
                prompt_token_ids=ids, num_cached_tokens=4 if last else None,
            )  # fmt: skip


def test_the_driver_sends_each_request_at_its_arrival_and_times_every_token():
    engine = FakeEngine()
    workload = _request_json(
        _workload(BenchRequest([10] * 8, 3, 0.0), BenchRequest([20] * 6, 2, 0.05)), repeat=2
    )
    passes = asyncio.run(vllm_driver.run_passes(engine, workload, lambda n: {"max_tokens": n}))
    assert len(passes) == 2, "the warm-up pass is not reported"
    first, second = passes[0]
    assert second["sent"] >= 0.05 > first["sent"]
    assert first["token_ids"] == [10, 11, 12] and second["token_ids"] == [20, 21]
    assert first["completion_tokens"] == 3 and len(first["token_times"]) == 3
    assert first["prompt_tokens"] == 8 and first["cached_tokens"] == 4
    assert first["sent"] < first["token_times"][0] < first["token_times"][1] < first["token_times"][2]
    warm, *measured = engine.prompts
    assert len(warm["prompt_token_ids"]) == 8 and len(measured) == 4
    salts = [p["cache_salt"] for p in engine.prompts]
    assert salts[1] == salts[2] != salts[3] == salts[4] != salts[0], "one salt per pass, shared within it"


def _answer(*passes) -> dict:
    return {"protocol": 1, "vllm_version": "0.32.0", "passes": list(passes)}


def _trace(sent, times, prompt=8, cached=0) -> dict:
    return {"sent": sent, "token_times": times, "token_ids": [1] * len(times), "prompt_tokens": prompt,
            "cached_tokens": cached, "completion_tokens": len(times)}  # fmt: skip


def test_vllm_figures_come_from_the_same_code_as_pagedserves():
    workload = _workload(BenchRequest([1] * 8, 3), BenchRequest([2] * 8, 2, 0.5))
    one = [_trace(0.0, [1.0, 1.1, 1.3]), _trace(0.5, [1.5, 2.0], cached=4)]
    slow = [_trace(0.0, [2.0, 2.2, 2.6]), _trace(0.5, [3.0, 4.0], cached=4)]
    figures = vllm_peer.figures(workload, _answer(one, one, slow))
    assert figures["wall_s"] == pytest.approx(2.0), "first sent to last token, the median pass"
    assert figures["tokens_per_s"] == pytest.approx((16 + 5) / 2.0)
    assert figures["generated_tokens_per_s"] == pytest.approx(5 / 2.0)
    assert figures["prompt_tokens_per_s"] == pytest.approx((16 - 4) / 1.5), "computed prompt tokens"
    assert figures["ttft_p50_ms"] == pytest.approx(1000.0)
    assert figures["itl_p50_ms"] == pytest.approx(200.0) and figures["itl_p99_ms"] == pytest.approx(500.0)
    assert figures["cached_prompt_tokens"] == 4 and figures["generated_tokens"] == 5
    assert all(figures[key] is None for key in driver.CACHE_ONLY), "pagedserve's cache only"


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (_answer([_trace(0.0, [1.0, 1.1])]), "1 of 2 requests"),
        (_answer([_trace(0.0, [1.0, 1.1]), _trace(0.0, [1.0])]), "request 1: 1 tokens"),
        ({**_answer([]), "protocol": 7}, "protocol 7"),
        ({**_answer(), "passes": []}, "no passes"),
    ],
)
def test_a_short_or_foreign_answer_is_an_error(answer, message):
    workload = _workload(BenchRequest([1] * 8, 2), BenchRequest([2] * 8, 2))
    with pytest.raises(ValueError, match=message):
        vllm_peer.figures(workload, answer)


def test_a_failing_driver_is_an_error_with_its_log(tmp_path):
    """The real driver script under this interpreter (which has no vLLM): it refuses the workload first."""
    bad = _request_json(_workload(BenchRequest([1] * 8, 2)), protocol=9)
    with pytest.raises(RuntimeError, match="exited with 2:\n.*bad workload: protocol 9"):
        vllm_peer.run_driver(sys.executable, bad, tmp_path)


def _imported_roots(nodes) -> set[str]:
    names = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module.split(".")[0])
    return names


def test_the_driver_imports_the_standard_library_at_module_level_and_vllm_inside_only():
    tree = ast.parse(Path(vllm_driver.__file__).read_text())
    assert _imported_roots(tree.body) <= sys.stdlib_module_names, "vLLM's spawned processes import it again"
    assert _imported_roots(ast.walk(tree)) - sys.stdlib_module_names == {"vllm"}, "nothing from pagedserve"


def test_ratios_say_who_is_ahead_and_vllm_comes_first():
    result = {
        "workload": "latency", "description": "d", "setup": "s", "vllm_setup": "vLLM 0.32.0: AsyncLLM",
        "pagedserve": {"tokens_per_s": 30.0, "itl_p50_ms": 100.0, "ttft_p50_ms": None},
        "peers": {"generate": {"tokens_per_s": 60.0}, "vLLM": {"tokens_per_s": 20.0, "itl_p50_ms": 50.0}},
    }  # fmt: skip
    ratios = report.ratios(result)
    assert ratios["vLLM"]["tokens_per_s"] == pytest.approx(1.5), "rates: pagedserve / peer"
    assert ratios["vLLM"]["itl_p50_ms"] == pytest.approx(0.5), "times: peer / pagedserve"
    assert ratios["vLLM"]["ttft_p50_ms"] is None and ratios["generate"]["tokens_per_s"] == pytest.approx(0.5)
    assert report.peer_names(result["peers"]) == ["vLLM", "generate_batch", "generate"]
    text = report.table(result)
    assert "(vLLM 0.32.0: AsyncLLM)" in text
    header = text.splitlines()[3].split()
    assert header[:4] == ["metric", "pagedserve", "vLLM", "generate_batch"]
    itl = next(line for line in text.splitlines() if line.startswith("inter-token p50"))
    assert itl.split()[-7:] == ["100.0", "50.0", "-", "-", "0.50x", "-", "-"]


def _flags(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    engines.add_flags(parser)
    return parser.parse_args(argv)


def test_peer_vllm_needs_an_interpreter(monkeypatch, tmp_path):
    vllm_peer.check_flags(_flags())
    with pytest.raises(SystemExit, match="--peer vllm needs --vllm-python PATH"):
        vllm_peer.check_flags(_flags("--peer", "vllm", "--vllm-python", ""))
    with pytest.raises(SystemExit, match="no such file"):
        vllm_peer.check_flags(_flags("--peer", "vllm", "--vllm-python", str(tmp_path / "python")))
    vllm_peer.check_flags(_flags("--peer", "vllm", "--vllm-python", sys.executable))
    assert _flags("--vllm-kv-memory", "1GiB").vllm_kv_memory == 2**30
    assert _flags().vllm_kv_memory == 256 * 2**20, "the cache service's default pool"
    assert _flags().vllm_dtype is None, "the stack's dtype"
    assert _flags("--vllm-dtype", "bfloat16").vllm_dtype == "bfloat16"
    with pytest.raises(SystemExit):
        _flags("--vllm-dtype", "float16")


def test_vllm_is_bound_to_every_cpu_the_bench_may_use_unless_told(monkeypatch):
    monkeypatch.setattr(binding.os, "sched_getaffinity", lambda pid: {0, 1})
    assert _flags().vllm_bind == binding.ALL
    assert binding.vllm_env(binding.ALL) == {
        "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "OMP_NUM_THREADS": "2"
    }  # fmt: skip
    assert binding.vllm_env("0,2-3")["OMP_NUM_THREADS"] == "3"
    assert "bound to CPUs 0-1, none reserved" in binding.vllm_label(binding.ALL)
    assert binding.vllm_env(binding.AUTO) == dict.fromkeys(binding.vllm_env(binding.ALL)), "vLLM's default"
    assert "vLLM's default binding" in binding.vllm_label(binding.AUTO)
    with pytest.raises(SystemExit):
        _flags("--vllm-bind", "0-")


def test_cpu_lists_read_and_written_as_ranges():
    assert binding.cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8" and binding.cpu_list([3]) == "3"
    assert binding.parse_cpu_list("0-2,5,7-8") == [0, 1, 2, 5, 7, 8]
    for bad in ("", "a", "1-", "2,1", "0-2,1"):
        with pytest.raises(ValueError):
            binding.parse_cpu_list(bad)


def test_the_binding_goes_into_vllms_environment_and_its_log_lines_come_back(tmp_path, monkeypatch):
    """A stand-in interpreter that writes what vLLM's worker would see, and logs as vLLM does."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "7")
    monkeypatch.setenv("OMP_NUM_THREADS", "9")
    python = tmp_path / "python"
    python.write_text(
        "#!/bin/sh\necho 'INFO OpenMP thread binding info: '\necho \"\tlocal_rank=0, core ids=[0, 1]\"\n"
        "echo 'loading'\n"
        'printf \'{"protocol": 1, "bind": "%s", "reserved": "%s", "threads": "%s"}\' '
        '"$VLLM_CPU_OMP_THREADS_BIND" "${VLLM_CPU_NUM_OF_RESERVED_CPU-unset}" '
        '"${OMP_NUM_THREADS-unset}" > $4\n'
    )
    python.chmod(0o755)
    request = _request_json(_workload(BenchRequest([1] * 8, 2)))
    answer = vllm_peer.run_driver(str(python), request, tmp_path, "0-1")
    assert (answer["bind"], answer["reserved"], answer["threads"]) == ("0-1", "0", "2")
    assert answer["binding_log"] == ["INFO OpenMP thread binding info: ", "\tlocal_rank=0, core ids=[0, 1]"]
    answer = vllm_peer.run_driver(str(python), request, tmp_path, binding.AUTO)
    assert (answer["bind"], answer["reserved"], answer["threads"]) == ("", "unset", "unset"), "vLLM's own"


def test_the_bench_refuses_peer_vllm_without_an_interpreter_before_starting_anything(monkeypatch):
    monkeypatch.delenv(vllm_peer.PYTHON_ENV, raising=False)
    parser = argparse.ArgumentParser()
    command.add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "--workload", "latency", "--peer", "vllm"])
    with pytest.raises(SystemExit, match="--peer vllm needs --vllm-python PATH"):
        command.run(args)
    monkeypatch.setenv(vllm_peer.PYTHON_ENV, sys.executable)
    args = parser.parse_args(["bench", "--workload", "latency", "--peer", "vllm"])
    vllm_peer.check_flags(args)
    assert args.vllm_python == sys.executable, "the variable when no flag"


def test_a_stuck_driver_is_killed_and_reported(tmp_path, monkeypatch):
    stuck = tmp_path / "python"
    stuck.write_text("#!/bin/sh\necho compiling\nexec sleep 60\n")
    stuck.chmod(0o755)
    monkeypatch.setattr(vllm_peer, "TIMEOUT_S", 1)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="ran past 1 s:\ncompiling"):
        vllm_peer.run_driver(str(stuck), _request_json(_workload(BenchRequest([1] * 8, 2))), tmp_path)
    assert time.monotonic() - started < 10, "killed, not waited for"


def test_a_failing_drivers_root_cause_is_reported_with_the_end_of_its_log(tmp_path):
    failing = tmp_path / "python"
    lines = "".join(f"echo line {i}\n" for i in range(40))
    failing.write_text(f"#!/bin/sh\necho 'ValueError: the root cause'\n{lines}exit 3\n")
    failing.chmod(0o755)
    with pytest.raises(
        RuntimeError, match="exited with 3:\nValueError: the root cause\n...\nline 20\n"
    ) as error:
        vllm_peer.run_driver(str(failing), _request_json(_workload(BenchRequest([1] * 8, 2))), tmp_path)
    assert str(error.value).endswith("line 39")
