"""`pagedserve up` takes every service setting with the service's own declaration and forwards it."""

import argparse
import os

import pytest

from cache_service.allocators import registry
from cache_service.server import parse_args
from cli import up
from common.options import add_address
from compute_service.server import parse_args as compute_args
from gateway.server import parse_args as gateway_args
from tests.helpers import ROOT

# What up decides for each service itself instead of taking it as a flag of the same meaning.
PLACEMENT = {"--host", "--port", "--http-port", "--metrics-port", "--cache-target", "--compute-target"}
PLACEMENT |= {"--socket", "--internal-certs", "--insecure"}
# A tensor-parallel group's rendezvous and ranks: compute's rank 0 places the others (or torchrun, a pod).
PLACEMENT |= {"--dist-init-addr", "--shard-rank"}
# Whether a compute is the warm standby: up starts it (--compute-standby).
PLACEMENT |= {"--standby"}
# A prefill compute beside the compute: up places it with --prefill-computes 1 (tests/unit/test_disagg.py).
PLACEMENT |= {"--prefill-compute-target"}
# The placement flags up gives each service: cache and compute listen on unix sockets only.
UP_PLACES = {
    "cache": {"--host", "--socket", "--metrics-port"},
    "compute": {"--host", "--socket", "--metrics-port"},
    "gateway": {"--host", "--port", "--http-port", "--metrics-port", "--cache-target", "--compute-target"},
}
# A value each flag accepts other than its default (switches and choices are derived).
VALUES = {"--kv-memory": "512MiB", "--allocator": "bitmap", "--model": "/models/other.gguf"}
VALUES |= {"--kv-device": "cuda:1"}
VALUES |= {"--kv-events-endpoint": "tcp://*:5557", "--kv-events-replay-endpoint": "ipc:///run/replay"}
VALUES |= {
    "--config": str(ROOT / "examples" / "pagedserve.yaml"),
    "--kv-tier": "rocksdb",
    "--kv-tier-hot": "0.5",
    "--sparse-attention": "sink=1,recent=2,topk=4",
    "--lora-modules": "sql=/adapters/sql",
    "--allowed-local-media-path": str(ROOT),
}


def up_parser() -> argparse.ArgumentParser:
    commands = argparse.ArgumentParser().add_subparsers()
    up.add_parser(commands)
    return commands.choices["up"]


def up_args(*argv: str) -> argparse.Namespace:
    return up_parser().parse_args(argv)


def flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {action.option_strings[0]: action for action in parser._actions if action.option_strings}


def service_args(name: str, command: list[str]) -> argparse.Namespace:
    """The command line up built for a service, read by that service's own parser."""
    options = up.OPTIONS[name]
    assert command[:3] == [command[0], "-m", options.module]
    return options.parser().parse_args(command[3:])


def settings() -> list[tuple[str, str]]:
    """(service, flag) for every setting of every service."""
    return [
        (name, flag)
        for name, options in up.OPTIONS.items()
        for flag in flags(options.parser())
        if flag not in PLACEMENT and flag != "-h"
    ]


def other_value(action: argparse.Action) -> list[str]:
    flag = action.option_strings[0]
    if action.nargs == 0:
        return [flag]
    if action.choices:
        return [flag, next((c for c in action.choices if c != action.default), action.default)]
    return [flag, VALUES.get(flag, "3")]


def test_each_entry_point_parses_with_its_declared_options():
    for name, parse, argv in (
        ("cache", parse_args, ["--insecure"]),
        ("compute", compute_args, ["--insecure"]),
        ("gateway", gateway_args, []),
    ):
        assert vars(parse(argv)).keys() == vars(up.OPTIONS[name].parser().parse_args([])).keys()


def test_every_service_flag_is_a_setting_or_placed_by_up():
    address = argparse.ArgumentParser()
    add_address(address, 1)
    for name, options in up.OPTIONS.items():
        placed = set(flags(options.parser())) & PLACEMENT
        assert set(flags(address)) - {"-h"} <= placed, f"{name} listens where up says"
        command = up.service_commands(up_args())[name]
        assert set(command) & placed == UP_PLACES[name], f"up sets the placement flags of {name}"


@pytest.mark.parametrize(("service", "flag"), settings())
def test_up_declares_the_setting_as_the_service_does(service, flag):
    ours, theirs = flags(up_parser())[flag], flags(up.OPTIONS[service].parser())[flag]
    for field in (
        "option_strings",
        "dest",
        "default",
        "type",
        "choices",
        "nargs",
        "const",
        "help",
        "required",
    ):
        assert getattr(ours, field) == getattr(theirs, field), f"{flag}: {field} differs from {service}'s"


@pytest.mark.parametrize(("service", "flag"), settings())
def test_a_setting_given_to_up_reaches_the_service(service, flag):
    action = flags(up.OPTIONS[service].parser())[flag]
    args = up_args(*other_value(action))
    assert getattr(args, action.dest) != action.default or action.choices == [action.default]
    for name, command in up.service_commands(args).items():
        parsed = service_args(name, command)
        defaults = up.OPTIONS[name].parser().parse_args([])
        for dest in vars(defaults).keys() & vars(args).keys() - {"host", "port", "metrics_port"}:
            assert getattr(parsed, dest) == getattr(args, dest), f"{name} got {dest} from up"


def test_up_passes_the_media_sources_to_the_gateway():
    media = ("--allowed-local-media-path", str(ROOT / "docs" / ".." / "docs"))
    args = up_args("--allowed-media-domains", "images.example", "127.0.0.1", *media)
    gateway = service_args("gateway", up.service_commands(args)["gateway"])
    assert gateway.allowed_media_domains == ["images.example", "127.0.0.1"]
    assert gateway.allowed_local_media_path == (ROOT / "docs").resolve()


def test_up_refuses_a_media_path_that_is_no_directory(capsys):
    with pytest.raises(SystemExit):
        up_args("--allowed-local-media-path", str(ROOT / "absent"))
    assert "--allowed-local-media-path: " in capsys.readouterr().err


def test_up_places_each_service():
    args = up_args(
        "--host", "0.0.0.0", "--port", "7001", "--runtime-dir", "/run/ps", "--metrics-port", "9500"
    )
    commands = up.service_commands(args)
    assert list(commands) == ["cache", "compute", "gateway"], "start order"
    placed = {name: service_args(name, command) for name, command in commands.items()}
    assert (placed["gateway"].host, placed["gateway"].port, placed["gateway"].metrics_port) == (
        "0.0.0.0",
        7001,
        9500,
    )
    assert (placed["cache"].host, placed["cache"].socket, placed["cache"].metrics_port) == (
        "127.0.0.1",
        "/run/ps/cache.sock",
        9501,
    )
    assert (placed["compute"].socket, placed["compute"].metrics_port) == ("/run/ps/compute.sock", 9502)
    assert (placed["gateway"].cache_target, placed["gateway"].compute_target) == (
        "unix:/run/ps/cache.sock",
        "unix:/run/ps/compute.sock",
    )
    assert not any(placed[name].insecure or placed[name].internal_certs for name in ("cache", "compute"))
    assert all(
        a.metrics_port == 0 for a in map(service_args, commands, up.service_commands(up_args()).values())
    )


@pytest.mark.parametrize("allocator", registry.available())
def test_up_passes_the_allocator_and_the_prefix_cache_switch(allocator):
    cache = up.service_commands(up_args("--allocator", allocator, "--no-prefix-cache"))["cache"]
    args = parse_args(cache[cache.index("cache_service") + 1 :])
    assert (args.allocator, args.prefix_cache) == (allocator, False)
    default = up.service_commands(up_args())["cache"]
    args = parse_args(default[default.index("cache_service") + 1 :])
    assert (args.allocator, args.prefix_cache) == ("freelist", True)


def test_up_passes_the_plain_linear_switch_to_compute():
    for argv, plain in (((), False), (("--plain-linear",), True)):
        compute = up.service_commands(up_args(*argv))["compute"]
        args = compute_args(compute[compute.index("compute_service") + 1 :])
        assert args.plain_linear is plain


def test_up_passes_the_unfused_switch_to_compute():
    for argv, unfused in (((), False), (("--unfused",), True)):
        compute = up.service_commands(up_args(*argv))["compute"]
        args = compute_args(compute[compute.index("compute_service") + 1 :])
        assert args.unfused is unfused


def test_up_passes_max_model_len_to_compute_and_refuses_a_non_count(capsys):
    for argv, length in (((), 0), (("--max-model-len", "2048"), 2048)):
        compute = up.service_commands(up_args(*argv))["compute"]
        assert compute_args(compute[compute.index("compute_service") + 1 :]).max_model_len == length
    with pytest.raises(SystemExit):
        up_args("--max-model-len", "-5")
    assert "'-5' is not a token count" in capsys.readouterr().err


def test_up_parses_sizes_as_the_cache_service_does(capsys):
    cache = up.service_commands(up_args("--kv-memory", "1.5 GiB"))["cache"]
    assert parse_args(cache[cache.index("cache_service") + 1 :]).kv_memory == 3 * 2**29
    with pytest.raises(SystemExit):
        up_args("--kv-memory", "lots")
    assert "invalid size 'lots'" in capsys.readouterr().err


def test_the_cache_service_refuses_an_unknown_allocator(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--allocator", "buddy"])
    assert "unknown allocator 'buddy'" in capsys.readouterr().err


def test_the_restart_policy_flags_stay_with_up():
    args = up_args("--max-restarts", "2", "--restart-window", "30", "--drain-timeout", "5")
    assert (args.max_restarts, args.restart_window) == (2, 30.0)
    commands = up.service_commands(args)
    assert not any(
        "--max-restarts" in command or "--restart-window" in command for command in commands.values()
    )
    assert service_args("gateway", commands["gateway"]).drain_timeout == 5.0


def test_up_keeps_a_compute_standby_for_one_cpu_rank_unless_told_otherwise(capsys):
    commands = up.service_commands(up_args())
    assert up.standby_commands(up_args()) == {"compute": [*commands["compute"], "--standby"]}
    assert service_args("compute", up.standby_commands(up_args())["compute"]).standby
    assert not any("--standby" in command for command in commands.values())
    assert up.standby_commands(up_args("--no-compute-standby")) == {}
    assert up.standby_commands(up_args("--kv-device", "cuda")) == {}
    assert up.standby_commands(up_args("--kv-device", "cuda", "--compute-standby")).keys() == {"compute"}
    assert up.standby_commands(up_args("--tensor-parallel-size", "2")) == {}
    assert up.run(up_args("--tensor-parallel-size", "2", "--compute-standby")) == 2
    assert "--compute-standby serves one rank" in capsys.readouterr().err


def test_compute_takes_over_only_a_unix_socket_of_one_rank(capsys):
    with pytest.raises(SystemExit):
        compute_args(["--insecure", "--standby"])
    assert "--standby takes over the unix socket of one rank" in capsys.readouterr().err


def test_up_puts_the_sockets_in_a_per_user_runtime_dir_by_default(monkeypatch):
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    command = up.service_commands(up_args("--port", "7001"))["cache"]
    assert service_args("cache", command).socket.endswith(f"/pagedserve-{os.getuid()}-7001/cache.sock")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    command = up.service_commands(up_args("--port", "7001"))["compute"]
    assert service_args("compute", command).socket == "/run/user/1000/pagedserve-7001/compute.sock"


@pytest.mark.parametrize("parse", [parse_args, compute_args])
def test_cache_and_compute_refuse_plaintext_tcp_unless_told(parse, capsys):
    with pytest.raises(SystemExit):
        parse(["--port", "7002"])
    assert "refusing plaintext TCP on 127.0.0.1:7002: give --socket PATH" in capsys.readouterr().err
    assert parse(["--insecure"]).insecure and parse(["--internal-certs", "/certs"]).internal_certs == "/certs"
    assert parse(["--socket", "/run/ps/s.sock"]).socket == "/run/ps/s.sock"
    with pytest.raises(SystemExit):
        parse(["--socket", "/run/ps/s.sock", "--insecure"])
    with pytest.raises(SystemExit):
        parse(["--socket", "/" + "s" * 120])
    assert "the kernel's limit" in capsys.readouterr().err


def test_up_waits_for_the_gateways_drain_and_the_caches_flush(tmp_path):
    assert up.stop_timeouts(up_args()) == {"gateway": 30 + up.DRAIN_MARGIN_S, "cache": 20 + up.DRAIN_MARGIN_S}
    given = up_args("--drain-timeout", "5", "--kv-tier-flush-timeout", "7")
    assert up.stop_timeouts(given) == {"gateway": 5 + up.DRAIN_MARGIN_S, "cache": 7 + up.DRAIN_MARGIN_S}
    config = tmp_path / "pagedserve.yaml"
    config.write_text("persistence:\n  flush_timeout: 45\n")
    assert up.stop_timeouts(up_args("--config", str(config)))["cache"] == 45 + up.DRAIN_MARGIN_S
