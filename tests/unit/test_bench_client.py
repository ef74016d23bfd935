"""`pagedserve bench --client vllm` without vLLM: the client's command lines, the figures read from its result
JSON, the race's table and page, the flags, the client driver's protocol and vLLM's server started, bound
and stopped (a stand-in server)."""

import argparse
import ast
import json
import sys
import textwrap
from pathlib import Path

import pytest

from cli import processes
from cli.bench import (
    binding,
    client_race,
    client_runs,
    command,
    page,
    summary,
    vllm_client_driver,
    vllm_server,
)
from cli.bench.client_runs import Shape

MODEL = Path("/models/smollm2")


def _bench(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    command.add_parser(parser.add_subparsers())
    return parser.parse_args(["bench", *argv])


def _options(argv: list[str]) -> dict[str, str | None]:
    """A command line as {flag: its value, or None for a switch}."""
    options, flag = {}, None
    for word in argv:
        if word.startswith("--"):
            flag = word
            options[flag] = None
        else:
            assert options[flag] is None, f"{flag} has one value"
            options[flag] = word
    return options


def _result(
    ttft: float = 600.0, tpot: float = 30.0, prompts: int = 32, output_len: int = 64, **changes
) -> dict:
    """The summary of a `vllm bench serve` result (vLLM 0.32's keys), as the client driver returns it."""
    result = {
        "completed": prompts, "failed": 0, "total_input_tokens": prompts * 256,
        "total_output_tokens": prompts * output_len, "duration": 90.0, "total_token_throughput": 117.0,
        "output_throughput": 23.4, "request_throughput": 0.36, "median_ttft_ms": ttft, "p50_ttft_ms": ttft,
        "p99_ttft_ms": 2 * ttft, "mean_ttft_ms": ttft, "median_tpot_ms": tpot, "p99_tpot_ms": 2 * tpot,
        "median_itl_ms": tpot, "p99_itl_ms": 3 * tpot, "max_concurrency": 1, "request_rate": "inf",
    }  # fmt: skip
    return {**result, **changes}


def test_each_run_is_the_users_command_line_for_the_shape_and_concurrency():
    options = _options(client_runs.argv("http://127.0.0.1:8000", MODEL, "SmolLM2", 16, 7, Shape()))
    assert options["--base-url"] == "http://127.0.0.1:8000" and options["--endpoint"] == "/v1/completions"
    assert options["--model"] == options["--tokenizer"] == str(MODEL), "the model directory's tokenizer"
    assert options["--served-model-name"] == "SmolLM2", "the name the server answers to"
    assert options["--dataset-name"] == "random" and options["--random-input-len"] == "256"
    assert options["--random-output-len"] == "64" and options["--num-prompts"] == "32"
    assert options["--max-concurrency"] == "16" and options["--seed"] == "7"
    assert "--ignore-eos" in options and options["--temperature"] == "0", "greedy, every token generated"
    assert options["--metric-percentiles"] == "50,99" and options["--percentile-metrics"] == "ttft,tpot,itl"


def test_a_warm_up_then_every_concurrency_each_on_a_seed_of_its_own():
    args = _bench("--client", "vllm", "--repeat", "2", "--seed", "5")
    runs = [_options(argv) for argv in client_race.runs("http://h:1", MODEL, "m", args)]
    warm_up, measured = runs[0], runs[1:]
    assert warm_up["--max-concurrency"] == warm_up["--num-prompts"] == "16" and warm_up["--seed"] == "5"
    assert [run["--max-concurrency"] for run in measured] == ["1", "4", "16"] * 2
    seeds = [run["--seed"] for run in runs]
    assert len(set(seeds)) == len(seeds), "no run finds another's prompts in the prefix cache"
    again = [_options(argv)["--seed"] for argv in client_race.runs("http://other:2", MODEL, "m", args)]
    assert again == seeds, "both servers get the same prompts"


def test_the_figures_are_the_clients_medians_and_99th_percentiles():
    figures = client_runs.figures(_result(), Shape())
    assert figures == {
        "total_tokens_per_s": 117.0, "output_tokens_per_s": 23.4, "ttft_p50_ms": 600.0, "ttft_p99_ms": 1200.0,
        "itl_p50_ms": 30.0, "itl_p99_ms": 90.0, "tpot_p50_ms": 30.0, "duration_s": 90.0,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"completed": 30, "failed": 2, "first_errors": ["HTTP 400"]},
            "of 32 requests \\(2 failed\\): HTTP 400",
        ),
        ({"total_output_tokens": 2000}, "counted 2000 output tokens, not 2048"),
        ({"median_tpot_ms": None}, None),
    ],
)
def test_a_run_that_lost_requests_or_tokens_is_an_error(changes, message):
    result = _result(**changes)
    if message is None:
        del result["median_tpot_ms"]
        message = "has no median_tpot_ms"
    with pytest.raises(ValueError, match=message):
        client_runs.figures(result, Shape())


def test_each_concurrency_gets_the_median_of_its_runs_with_the_cpu_its_processes_spent():
    args = _bench("--client", "vllm", "--repeat", "3", "--concurrency", "1", "16")
    runs = [
        _result(ttft=100.0 * (r + 1), tpot=c) | {"cpu_seconds": {"compute": c * (r + 1), "gateway": 1.0}}
        for r in range(3)
        for c in (10.0, 20.0)
    ]
    figures = client_race.figures(runs, args)
    assert list(figures) == ["1", "16"]
    assert figures["1"]["ttft_p50_ms"] == 200.0 and figures["1"]["tpot_p50_ms"] == 10.0
    assert figures["16"]["tpot_p50_ms"] == 20.0
    assert figures["16"]["cpu_s_compute"] == 40.0 and figures["1"]["cpu_s_gateway"] == 1.0


def _race(peer: bool = True) -> dict:
    ours = {"1": client_runs.figures(_result(ttft=643.0, tpot=32.9), Shape())}
    ours["16"] = client_runs.figures(_result(ttft=2300.0, tpot=250.0, total_token_throughput=266.0), Shape())
    for level, cpu in (("1", 30.0), ("16", 54.6)):
        ours[level] |= {"cpu_s_compute": cpu, "cpu_s_gateway": 2.8}
    result = {
        "workload": client_race.NAME, "description": "vLLM's client over HTTP", "date": "2026-12-07T10:00:00",
        "machine": "AMD EPYC, 2 vCPUs, AVX2", "client": {"name": "vllm", "version": "0.32.0"},
        "setup": "pagedserve up: float32", "pagedserve": ours,
    }  # fmt: skip
    if peer:
        theirs = {
            "1": client_runs.figures(_result(ttft=529.0, tpot=41.1, total_token_throughput=103.0), Shape()),
            "16": client_runs.figures(
                _result(ttft=4400.0, tpot=145.0, total_token_throughput=328.0), Shape()
            ),
        }
        for level, cpu in (("1", 25.0), ("16", 50.0)):
            theirs[level] |= {"cpu_s_api server": 3.0, "cpu_s_engine": cpu}
        result |= {"peers": {"vLLM": theirs}, "vllm_setup": "vLLM 0.32.0: its OpenAI server"}
        result["peer_settings"] = {"vLLM": {"binding_log": ["\tlocal_rank=0, core ids=[0, 1]"]}}
    return result


def test_the_table_has_a_row_per_concurrency_ours_theirs_and_the_ratio():
    header, rows = client_race.rows(_race())
    assert header[:2] == ["concurrency", "total tokens/s, pagedserve / vLLM"]
    row = dict(zip(header, rows[1], strict=True))
    assert row["concurrency"] == "16"
    assert row["total tokens/s, pagedserve / vLLM"] == "266 / 328 (0.81×)", "rates: ours / theirs"
    assert row["time per output token median (ms), pagedserve / vLLM"] == "250.0 / 145.0 (0.58×)", (
        "times: theirs / ours"
    )
    assert rows[0][2] == "643 / 529 (0.82×)"
    alone_header, alone = client_race.rows(_race(peer=False))
    assert alone_header[1] == "total tokens/s" and alone[1][1] == "266", "no peer, no peer figures"
    text = client_race.table(_race())
    assert "(vLLM 0.32.0: its OpenAI server)" in text and "266 / 328 (0.81×)" in text


def test_the_cpu_each_servers_processes_spent_is_a_table_of_its_own():
    header, rows = client_race.cpu_rows(_race())
    assert header == [
        "concurrency", "pagedserve compute CPU (s)", "pagedserve gateway CPU (s)", "vLLM api server CPU (s)",
        "vLLM engine CPU (s)",
    ]  # fmt: skip
    assert rows == [["1", "30.0", "2.8", "3.0", "25.0"], ["16", "54.6", "2.8", "3.0", "50.0"]]
    assert client_race.cpu_rows(_race(peer=False))[0][1:] == header[1:3], "no peer, no peer columns"


def test_the_page_shows_the_race_and_the_readme_table_leaves_it_out(tmp_path):
    root = tmp_path / "docs" / "bench"
    (root / "http-client").mkdir(parents=True)
    (root / "http-client" / "vllm-bench-serve.json").write_text(json.dumps(_race()))
    text = page.render(root, tmp_path / "docs" / "performance.md")
    section = text.split("## `bench/http-client/`", 1)[1]
    assert "### http-client: vLLM's client over HTTP" in section
    assert "| 16 | 266 / 328 (0.81×) |" in section and "AMD EPYC, 2 vCPUs, AVX2" in section
    assert "CPU binding: vLLM logged local_rank=0, core ids=[0, 1]" in section
    assert "| 16 | 54.6 | 2.8 | 3.0 | 50.0 |" in section, "the CPU table too"
    (root / "http-client.json").write_text(json.dumps(_race()))
    with pytest.raises(ValueError, match="no bench JSON file under .* ran vLLM"):
        summary.table(root)


def test_client_and_workload_go_one_at_a_time_and_the_client_needs_vllms_interpreter(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_VLLM_PYTHON", raising=False)
    for argv, message in (
        ((), "give --workload NAME or --client NAME"),
        (("--workload", "latency", "--client", "vllm"), "give --workload NAME or --client NAME"),
        (("--client", "vllm"), "--client vllm needs --vllm-python PATH"),
        (("--client", "vllm", "--vllm-python", sys.executable, "--target", "h:1"), "--target does not go"),
        (("--client", "vllm", "--vllm-python", sys.executable, "--concurrency", "0"), "at least 1"),
    ):
        with pytest.raises(SystemExit, match=message):
            command.run(_bench(*argv))
    monkeypatch.setenv("PAGEDSERVE_VLLM_PYTHON", sys.executable)
    args = _bench("--client", "vllm")
    client_race.check_flags(args)
    assert args.vllm_python == sys.executable and args.concurrency == [1, 4, 16] and args.client_prompts == 32


def test_the_client_driver_reads_runs_and_keeps_the_results_summary():
    runs = [client_runs.argv("http://h:1", MODEL, "m", 4, 1, Shape())]
    assert vllm_client_driver.read_runs(json.dumps({"protocol": 1, "runs": runs})) == runs
    for bad, message in (
        ({"protocol": 2, "runs": runs}, "protocol 2"),
        ({"protocol": 1, "runs": []}, "no runs"),
        ({"protocol": 1, "runs": [[1]]}, "run 0 is not a list"),
    ):
        with pytest.raises(ValueError, match=message):
            vllm_client_driver.read_runs(json.dumps(bad))
    result = {"duration": 1.0, "ttfts": [0.1, 0.2], "errors": ["", "HTTP 400", "", "a", "b", "c"]}
    assert vllm_client_driver.summary(result) == {"duration": 1.0, "first_errors": ["HTTP 400", "a", "b"]}


def test_the_client_driver_imports_the_standard_library_at_module_level_and_vllm_inside_only():
    tree = ast.parse(Path(vllm_client_driver.__file__).read_text())
    roots = {
        (node.module if isinstance(node, ast.ImportFrom) else node.names[0].name).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
    }
    top = {node.names[0].name for node in tree.body if isinstance(node, ast.Import)}
    assert top <= sys.stdlib_module_names and roots - sys.stdlib_module_names == {"vllm"}


def test_a_client_driver_that_refuses_its_runs_is_an_error_with_its_log(monkeypatch):
    """The real driver under this interpreter (no vLLM here): it refuses a foreign protocol first."""
    monkeypatch.setattr(client_runs, "PROTOCOL", 9)
    with pytest.raises(RuntimeError, match="exited with 2:\n.*bad runs: protocol 9"):
        client_runs.run(sys.executable, [["--num-prompts", "1"]])


def test_vllms_server_gets_the_same_model_dtype_kv_bytes_and_prefix_caching():
    argv = vllm_server.argv("/venv/python", MODEL, "SmolLM2", "float32", 2**28, 2048, 8123)
    assert argv[:4] == ["/venv/python", "-P", "-m", "vllm.entrypoints.openai.api_server"]
    options = _options(argv[4:])
    assert options["--model"] == str(MODEL) and options["--served-model-name"] == "SmolLM2"
    assert options["--dtype"] == "float32" and options["--kv-cache-memory-bytes"] == str(2**28)
    assert "--enable-prefix-caching" in options and options["--port"] == "8123"


STAND_IN = """\
#!{python}
# vLLM's server as far as the bench sees it: /health, its binding log line, a child process of its own.
import http.server, os, subprocess, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
print("INFO core ids=[0, 1] bind=" + os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "unset"), flush=True)
child = subprocess.Popen(["sleep", "600"])
open({pids!r}, "w").write(str(child.pid))
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def test_vllms_server_is_bound_waited_for_and_stopped_with_its_children(tmp_path, monkeypatch):
    monkeypatch.setattr(binding.os, "sched_getaffinity", lambda pid: {0, 1})
    python, pids = tmp_path / "python", tmp_path / "child.pid"
    python.write_text(textwrap.dedent(STAND_IN.format(python=sys.executable, pids=str(pids))))
    python.chmod(0o755)
    log = tmp_path / "server.log"
    with vllm_server.server(str(python), MODEL, "m", "float32", 2**28, 2048, binding.ALL, log) as (url, pid):
        assert url.startswith("http://127.0.0.1:")
        child = int(pids.read_text())
        assert processes.children_of(pid) == [child], "its engine core, as vLLM's server starts one"
        assert processes.cpu_seconds(pid) > 0
    assert vllm_server.binding_lines(log) == ["INFO core ids=[0, 1] bind=0-1"], "bound to every CPU"
    stat = Path(f"/proc/{child}/stat")
    assert not stat.exists() or stat.read_text().split()[2] == "Z", "its child stopped with it"


def test_a_server_that_exits_before_it_is_healthy_is_an_error_with_its_log(tmp_path):
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho 'ValueError: no such model'\nexit 1\n")
    python.chmod(0o755)
    starting = vllm_server.server(
        str(python), MODEL, "m", "float32", 2**28, 2048, binding.ALL, tmp_path / "l"
    )
    with pytest.raises(RuntimeError, match="exited with 1:\nValueError: no such model"), starting:
        pass
