"""How many torch threads a step runs on: all of --threads, except a step of one new token (a single stream
decoding), which runs on --single-stream-threads.

NOTE: on a small host the gateway and its clients share the cores with compute. A one-token decode step is
memory-bound and short, and when compute spreads it over every core, any gateway or client work preempts
one of its threads and stalls the whole parallel region; steps of many streams still gain from every thread.
Measured through the stack with `pagedserve bench --workload latency` and `--workload throughput`
(docs/internals/cpu-fast-path.md, One core fewer for one stream).
"""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ThreadPolicy:
    threads: int  # every step but a single stream's
    single_stream: int  # a step of one new token

    def __post_init__(self) -> None:
        assert self.threads >= 1 and self.single_stream >= 1, self

    @classmethod
    def from_flags(cls, threads: int | None, single_stream: int | None) -> "ThreadPolicy":
        """--threads (default: torch's) and --single-stream-threads (default: --threads minus one, at least
        one: a core left to the gateway and its clients)."""
        total = threads or torch.get_num_threads()
        return cls(total, single_stream or max(1, total - 1))

    def apply(self, num_tokens: int) -> None:
        """Sets torch's threads for a step of `num_tokens` new tokens."""
        wanted = self.single_stream if num_tokens == 1 else self.threads
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)
