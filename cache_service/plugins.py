"""Swappable parts by name, so a flag picks one at start-up (`--allocator`, `--kv-tier`).

A name is a built-in, an entry point in the part's group of any installed distribution, or a dotted path
`package.module:Class`; third-party parts need no change to pagedserve.
"""

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata

from common.errors import InvalidArgument


@dataclass(frozen=True)
class Plugins:
    """The classes of one kind of part: `kind` names it in messages, each a subclass of `base`."""

    kind: str
    base: type
    entry_point_group: str
    builtin: Mapping[str, type]

    def _entry_points(self) -> dict[str, metadata.EntryPoint]:
        return {ep.name: ep for ep in metadata.entry_points(group=self.entry_point_group)}

    def available(self) -> list[str]:
        """Built-in and entry-point names (dotted paths are accepted too, but not listed)."""
        return sorted(self.builtin.keys() | self._entry_points().keys())

    def resolve(self, name: str) -> type:
        """The class `name` names; InvalidArgument if it names none or not a subclass of `base`."""
        if name in self.builtin:
            return self.builtin[name]
        entry_points = self._entry_points()
        if name in entry_points:
            cls = entry_points[name].load()
        elif ":" in name:
            module, _, attr = name.partition(":")
            try:
                cls = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError) as err:
                raise InvalidArgument(f"cannot load {self.kind} {name!r}: {err}") from err
        else:
            raise InvalidArgument(
                f"unknown {self.kind} {name!r}; choose one of {', '.join(self.available())} or give "
                "package.module:Class"
            )
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise InvalidArgument(f"{self.kind} {name!r} is {cls!r}, not a {self.base.__name__} subclass")
        return cls
