"""The launcher's side of the services' lifelines (common/lifeline.py): one pipe per service, in start
order. A service reads its own; the launcher holds every write end for its life, and each service holds
the write ends of the services started before it (those it calls: the gateway calls compute and cache,
compute maps the cache's pool). So a service is told to stop only once the launcher and every service after
it have exited, whichever way they did; while the launcher lives, a service that exits is restarted and
given its ends again."""

import os

from common import lifeline


class Lifelines:
    def __init__(self, names: list[str]) -> None:
        self._pipes = {name: os.pipe() for name in names}

    def of(self, name: str) -> tuple[tuple[int, ...], str]:
        """The fds the service `name` inherits and the value of its lifeline.ENV variable."""
        names = list(self._pipes)
        read = self._pipes[name][0]
        held = [self._pipes[before][1] for before in names[: names.index(name)]]
        return (read, *held), lifeline.encode(read, held)

    def close(self) -> None:
        """Closes the launcher's ends (after the services stopped)."""
        for read, write in self._pipes.values():
            os.close(read)
            os.close(write)
        self._pipes = {}
