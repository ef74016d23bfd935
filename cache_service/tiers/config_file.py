"""`--config pagedserve.yaml`: the `persistence:` section of the issue (enabled, storage_path,
hot_blocks_threshold) and the tier's other settings. Every key is checked as its flag is; an unknown key is
refused, naming the keys accepted. Flags given on the command line win over the file."""

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from cache_service.units import fraction, parse_size, positive_int, size_or_zero
from common.options import positive_seconds

SECTION = "persistence"
# persistence key -> (the flag's dest, its conversion)
KEYS: dict[str, tuple[str, Callable[[str], object]]] = {
    "storage_path": ("kv_tier_path", str),
    "hot_blocks_threshold": ("kv_tier_hot", fraction),
    "tier": ("kv_tier", str),
    "budget": ("kv_tier_budget", parse_size),
    "max_load_blocks": ("kv_tier_max_load", positive_int),
    "write_queue": ("kv_tier_queue", parse_size),
    "flush_on_stop": ("kv_tier_flush", size_or_zero),
    "flush_timeout": ("kv_tier_flush_timeout", positive_seconds),
}
ENABLED = "enabled"


@dataclass(frozen=True)
class ConfigFile:
    """A checked file: the flag values it sets, by dest. Prints as its path (so `pagedserve up` forwards
    `--config PATH` to the cache service)."""

    path: Path
    settings: dict[str, object] = field(default_factory=dict)

    def __str__(self) -> str:
        return str(self.path)


def load(text: str) -> ConfigFile:
    """The file at `text`, read and checked (argparse's type for --config: errors name the file and key)."""
    path = Path(text).resolve()
    try:
        document = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {err}") from err
    return ConfigFile(path, parse(document or {}, str(path)))


def parse(document: object, where: str) -> dict[str, object]:
    """The flag values a parsed YAML document sets; ArgumentTypeError for anything not understood."""
    top = _mapping(document, where, {SECTION})
    section = _mapping(top.get(SECTION) or {}, f"{where}: {SECTION}", {ENABLED, *KEYS})
    settings = {}
    for key, value in section.items():
        if key == ENABLED:
            continue
        dest, convert = KEYS[key]
        try:
            settings[dest] = convert(str(value))
        except argparse.ArgumentTypeError as err:
            raise argparse.ArgumentTypeError(f"{where}: {SECTION}.{key}: {err}") from err
    if ENABLED in section:
        enabled = section[ENABLED]
        if not isinstance(enabled, bool):
            raise argparse.ArgumentTypeError(
                f"{where}: {SECTION}.{ENABLED} must be true or false, got {enabled!r}"
            )
        settings["kv_tier"] = settings.get("kv_tier", "rocksdb") if enabled else "none"
    return settings


def _mapping(value: object, where: str, accepted: set[str]) -> dict:
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{where}: expected a mapping of keys, got {type(value).__name__}")
    unknown = sorted(str(key) for key in value.keys() - accepted)
    if unknown:
        raise argparse.ArgumentTypeError(
            f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
            f"accepted: {', '.join(sorted(accepted))}"
        )
    return value
