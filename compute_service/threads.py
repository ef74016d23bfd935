"""How many torch threads a step runs on: all of --threads, except a step of one new token (a single stream
decoding), which runs on --single-stream-threads.

NOTE: a one-token decode step is short and memory-bound. Two threads on separate physical cores each bring
their own load bandwidth and caches; two SMT siblings (hyper-threads of one core) share them, so the second
adds little, and the gateway's and clients' work, which lands on it, preempts one of the step's threads and
stalls the whole parallel region. So by default a single stream runs on one thread per physical core
compute may use. Measured through the stack with `pagedserve bench --workload latency`
(docs/internals/cpu-fast-path.md, One thread per core for one stream).
"""

from dataclasses import dataclass

import torch

from common.cpu import physical_cores


@dataclass(frozen=True)
class ThreadPolicy:
    threads: int  # every step but a single stream's
    single_stream: int  # a step of one new token

    def __post_init__(self) -> None:
        if self.threads < 1 or self.single_stream < 1:
            raise ValueError(f"--threads and --single-stream-threads must be at least 1, not {self}")

    @classmethod
    def from_flags(
        cls, threads: int | None, single_stream: int | None, cores: int | None = None
    ) -> "ThreadPolicy":
        """--threads (default: torch's) and --single-stream-threads (default: one per physical core compute
        may use, `cores`; at most --threads)."""
        total = threads or torch.get_num_threads()
        return cls(total, single_stream or min(total, cores or physical_cores()))

    def apply(self, num_tokens: int) -> None:
        """Sets torch's threads for a step of `num_tokens` new tokens."""
        wanted = self.single_stream if num_tokens == 1 else self.threads
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)
