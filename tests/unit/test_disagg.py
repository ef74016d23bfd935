"""Disaggregated prefill and decode (gateway/disagg.py, cli/roles.py): which rows of a step run on the prefill
compute, the flags `up` refuses, and the services it starts with a prefill compute."""

import argparse

import pytest

from cli import roles, up
from compute_service.server import parse_args as compute_args
from gateway.disagg import routes_to_prefill, split
from gateway.server import parse_args as gateway_args
from tests.scheduling import make, run, seq


def test_long_prompt_chunks_route_to_the_prefill_compute_and_decodes_and_short_prompts_stay():
    scheduler = make(block_size=16, num_blocks=100, max_batched_tokens=200, max_seqs=8)
    for name, n in (("running", 8), ("long", 300), ("short", 20)):
        scheduler.add(seq(name, n))
        if name == "running":
            run(scheduler, scheduler.schedule())
    step = scheduler.schedule()
    assert {s.seq_id: s.chunk_len for s in step.seqs} == {"running": 1, "long": 199}
    prefill, decode = split(step.seqs, threshold=64)
    assert [s.seq_id for s in prefill] == ["long"]
    assert [s.seq_id for s in decode] == ["running"], "a decode never goes to the prefill compute"
    run(scheduler, step)
    step = scheduler.schedule()
    chunks = {s.seq_id: s.chunk_len for s in step.seqs}
    assert chunks == {"running": 1, "long": 101, "short": 20}
    prefill, decode = split(step.seqs, threshold=64)
    assert [s.seq_id for s in prefill] == ["long"]
    assert [s.seq_id for s in decode] == ["running", "short"], "a prompt under the threshold stays"
    assert [s.seq_id for s in split(step.seqs, threshold=21)[0]] == ["long"]
    assert [s.seq_id for s in split(step.seqs, threshold=20)[0]] == ["long", "short"], "at the threshold"


def test_the_threshold_counts_the_tokens_left_to_compute():
    scheduler = make(block_size=16, num_blocks=100, max_batched_tokens=64, max_seqs=8)
    long = seq("long", 100)
    scheduler.add(long)
    routed = []
    while not long.output_ids:
        step = scheduler.schedule()
        routed.append(routes_to_prefill(long, threshold=64))
        run(scheduler, step)
    assert routed == [True, False], "the last 36 tokens stay on the decode compute"
    step = scheduler.schedule()
    assert long.is_decode and not routes_to_prefill(long, threshold=0), "a decode, whatever the threshold"


def up_args(*argv: str) -> argparse.Namespace:
    commands = argparse.ArgumentParser().add_subparsers()
    up.add_parser(commands)
    return commands.choices["up"].parse_args(list(argv))


@pytest.mark.parametrize(
    ("argv", "refusal"),
    [
        (("--prefill-computes", "2"), "one host serves 1 decode compute and 0 or 1 prefill compute"),
        (("--decode-computes", "2"), "one host serves 1 decode compute and 0 or 1 prefill compute"),
        (("--prefill-computes", "1", "--tensor-parallel-size", "2"), "a prefill compute serves one rank"),
        (("--prefill-computes", "1", "--enable-lora"), "adapters load on the decode compute only"),
    ],
)
def test_up_refuses_roles_it_cannot_serve(argv, refusal):
    assert refusal in roles.refuse_roles(up_args(*argv))


def test_up_accepts_one_prefill_compute_or_none():
    assert roles.refuse_roles(up_args()) is None
    assert roles.refuse_roles(up_args("--prefill-computes", "1", "--threads", "1")) is None
    assert roles.refuse_roles(up_args("--tensor-parallel-size", "2")) is None


def test_up_starts_a_prefill_compute_with_the_computes_settings_on_its_own_socket(tmp_path):
    args = up_args("--prefill-computes", "1", "--threads", "1", "--runtime-dir", str(tmp_path),
                   "--metrics-port", "9000", "--prefill-threshold", "32")  # fmt: skip
    commands = up.service_commands(args)
    assert list(commands) == ["cache", "compute", "prefill", "gateway"]
    compute = compute_args(commands["compute"][3:])
    prefill = compute_args(commands["prefill"][3:])
    assert prefill.threads == compute.threads == 1 and prefill.model == compute.model
    assert (prefill.socket, compute.socket) == (
        str(tmp_path / "prefill.sock"),
        str(tmp_path / "compute.sock"),
    )
    assert (prefill.metrics_port, compute.metrics_port) == (0, 9002)
    gateway = gateway_args(commands["gateway"][3:])
    assert gateway.prefill_compute_target == f"unix:{tmp_path / 'prefill.sock'}"
    assert gateway.prefill_threshold == 32
    plain = up.service_commands(up_args("--runtime-dir", str(tmp_path)))
    assert list(plain) == ["cache", "compute", "gateway"]
    assert gateway_args(plain["gateway"][3:]).prefill_compute_target == ""
