"""The client commands start like any CLI: `pagedserve --help` and each client command, parsed and run
(against nothing listening), import no torch, transformers, bench or service code; `up`'s launcher, which
declares every service's flags and forwards them, imports no torch or transformers either; every command's
flags still parse."""

import json
import subprocess
import sys

import pytest

from cli import main
from tests.helpers import ROOT, free_port

# Top-level packages (and the bench) a client command must not load.
HEAVY = ("torch", "transformers", "numpy", "matplotlib", "cache_service", "compute_service", "gateway")
LOADED = """
import json, sys
from cli import main
try:
    main.main(json.loads(sys.argv[1]))
except SystemExit:
    pass
print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {heavy} or m.startswith('cli.bench'))))
"""

# What `up`'s launcher runs besides starting the services and probing them: its flags parsed, each service's
# command line and stop timeout derived, a dead cache's segments removed.
LAUNCHER = """
import json, os, sys
from cli import main, up
args = main.parser("up").parse_args(["up", "--sparse-attention", "on", "--weights", "int8"])
commands = up.service_commands(args)
up.stop_timeouts(args)
up._remove_segments("cache", os.getpid() + 1)
print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {"torch", "transformers", "numpy"})))
print(json.dumps(commands["compute"]))
"""


def loaded(argv: list[str]) -> list[str]:
    """The heavy modules loaded by a fresh interpreter that runs `pagedserve argv`."""
    code = LOADED.format(heavy=set(HEAVY))
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(argv)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def client_commands(tmp_path) -> dict[str, list[str]]:
    closed = str(free_port())
    target = f"127.0.0.1:{closed}"
    return {
        "help": ["--help"],
        "generate --help": ["generate", "--help"],
        "generate": ["generate", "hi", "--max-tokens", "4", "--target", target, "--timeout", "2"],
        "stats": ["stats", "--cache-target", target, "--timeout", "2"],
        "monitor": ["monitor", "--once", "--metrics-port", closed],
        "certs": ["certs", "--out", str(tmp_path / "certs")],
    }


@pytest.mark.parametrize("name", ["help", "generate --help", "generate", "stats", "monitor", "certs"])
def test_client_commands_load_no_heavy_module(tmp_path, name):
    assert loaded(client_commands(tmp_path)[name]) == []


def test_the_up_launcher_loads_no_torch_or_transformers():
    out = subprocess.run(
        [sys.executable, "-c", LAUNCHER], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    heavy, compute = map(json.loads, out.stdout.splitlines()[-2:])
    assert heavy == []
    assert compute[compute.index("--sparse-attention") + 1] == "sink=1,recent=4,topk=8"
    assert compute[compute.index("--weights") + 1] == "int8"


def test_up_and_bench_still_declare_their_flags():
    up = main.parser("up").parse_args(["up", "--kv-blocks", "64", "--dtype", "float32"])
    assert (up.kv_blocks, up.dtype) == (64, "float32")
    bench = main.parser("bench").parse_args(["bench", "--workload", "latency", "--no-peers"])
    assert bench.workload == "latency" and bench.no_peers


def test_every_command_is_listed_and_an_unknown_one_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        main.main(["--help"])
    assert exit_.value.code == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in main.COMMANDS)
    with pytest.raises(SystemExit) as exit_:
        main.main(["genrate", "hi"])
    assert exit_.value.code == 2
    assert "invalid choice: 'genrate'" in capsys.readouterr().err
