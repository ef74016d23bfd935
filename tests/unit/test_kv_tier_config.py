"""`--config pagedserve.yaml`: the persistence keys, refusals naming the key, and flags winning over the file
(in the cache service and through `pagedserve up`)."""

import argparse
from pathlib import Path

import pytest

from cache_service.options import OPTIONS
from cache_service.server import parse_args
from cache_service.tiers import config_file
from cli import up
from tests.helpers import ROOT

ISSUE_EXAMPLE = """
persistence:
  enabled: true
  storage_path: "/mnt/ssd/vllm_cache"
  hot_blocks_threshold: 0.8
"""


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "pagedserve.yaml"
    path.write_text(text)
    return str(path)


def cache_args(*argv: str) -> argparse.Namespace:
    return parse_args(["--insecure", *argv])


def test_the_issue_example_turns_the_rocksdb_tier_on(tmp_path: Path):
    args = cache_args("--config", write(tmp_path, ISSUE_EXAMPLE))
    assert (args.kv_tier, args.kv_tier_path, args.kv_tier_hot) == ("rocksdb", "/mnt/ssd/vllm_cache", 0.8)
    assert (args.kv_tier_budget, args.kv_tier_max_load, args.kv_tier_queue) == (8 * 2**30, 256, 256 * 2**20)


def test_the_example_file_parses():
    args = cache_args("--config", str(ROOT / "examples" / "pagedserve.yaml"))
    assert (args.kv_tier, args.kv_tier_budget, args.kv_tier_hot) == ("rocksdb", 8 * 2**30, 0.8)


def test_without_file_or_flags_there_is_no_tier():
    args = cache_args()
    assert (args.kv_tier, args.kv_tier_path, args.kv_tier_hot) == ("none", None, 0.8)


def test_flags_win_over_the_file_even_at_their_default_value(tmp_path: Path):
    text = ISSUE_EXAMPLE + "  budget: 1GiB\n  max_load_blocks: 9\n"
    path = write(tmp_path, text.replace("0.8", "0.3"))
    args = cache_args("--config", path, "--kv-tier-hot", "0.8", "--kv-tier-path", "/elsewhere")
    assert (args.kv_tier_hot, args.kv_tier_path, args.kv_tier_budget, args.kv_tier_max_load) == (
        0.8,
        "/elsewhere",
        2**30,
        9,
    )
    assert cache_args("--kv-tier", "none", "--config", path).kv_tier == "none"


def test_enabled_false_turns_the_tier_off(tmp_path: Path):
    args = cache_args("--config", write(tmp_path, ISSUE_EXAMPLE.replace("true", "false")))
    assert args.kv_tier == "none"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("persistance:\n  enabled: true\n", "unknown key persistance; accepted: persistence"),
        ("persistence:\n  enable: true\n  path: x\n", "unknown keys enable, path; accepted: budget, enabled"),
        ("persistence:\n  enabled: yes please\n", "persistence.enabled must be true or false"),
        (
            "persistence:\n  hot_blocks_threshold: 1.5\n",
            "hot_blocks_threshold: expected a number from 0 to 1",
        ),
        ("persistence:\n  budget: lots\n", "persistence.budget: invalid size 'lots'"),
        ("persistence:\n  max_load_blocks: 0\n", "max_load_blocks: expected a positive integer"),
        ("- persistence\n", "expected a mapping of keys, got list"),
        ("persistence: [1]\n", "persistence: expected a mapping"),
        ("persistence: {enabled: true\n", "cannot read"),
    ],
)
def test_a_bad_file_is_refused_naming_the_key(tmp_path: Path, capsys, text: str, message: str):
    with pytest.raises(SystemExit):
        cache_args("--config", write(tmp_path, text))
    err = capsys.readouterr().err
    assert "argument --config" in err and message in err and str(tmp_path) in err


def test_a_missing_file_and_a_tier_without_path_are_refused(tmp_path: Path, capsys):
    with pytest.raises(SystemExit):
        cache_args("--config", str(tmp_path / "absent.yaml"))
    assert "No such file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cache_args("--config", write(tmp_path, "persistence:\n  enabled: true\n"))
    assert "--kv-tier rocksdb needs --kv-tier-path (or persistence.storage_path)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cache_args("--kv-tier", "tape", "--kv-tier-path", "/x")
    assert "unknown KV tier 'tape'" in capsys.readouterr().err


def test_up_checks_the_file_and_the_cache_service_applies_it_under_the_flags(tmp_path: Path, capsys):
    commands = argparse.ArgumentParser().add_subparsers()
    up.add_parser(commands)
    parser = commands.choices["up"]
    path = write(tmp_path, ISSUE_EXAMPLE.replace("0.8", "0.3"))
    for argv, hot in (([], 0.3), (["--kv-tier-hot", "0.8"], 0.8)):
        cache = up.service_commands(parser.parse_args(["--config", path, *argv]))["cache"]
        args = parse_args(cache[cache.index("cache_service") + 1 :])
        assert (args.kv_tier, args.kv_tier_hot, str(args.config)) == ("rocksdb", hot, path)
    with pytest.raises(SystemExit):
        parser.parse_args(["--config", write(tmp_path, "persistence:\n  colour: blue\n")])
    assert "unknown key colour" in capsys.readouterr().err


def test_the_file_keys_are_the_flags_dests():
    dests = {action.dest for action in OPTIONS.parser()._actions}
    assert {dest for dest, _ in config_file.KEYS.values()} <= dests
