"""`pagedserve up` hands the cache and compute flags to the services' command lines."""

import argparse

import pytest

from cache_service.allocators import registry
from cache_service.server import parse_args
from cli import up
from compute_service.server import parse_args as compute_args


def up_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    up.add_parser(parser.add_subparsers())
    return parser.parse_args(["up", *argv])


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


def test_the_cache_service_refuses_an_unknown_allocator(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--allocator", "buddy"])
    assert "unknown allocator 'buddy'" in capsys.readouterr().err
