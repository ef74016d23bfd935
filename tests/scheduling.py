"""Driving the gateway's scheduler over a fake cache service, as the engine would, for unit tests."""

import itertools
from dataclasses import replace

from gateway.config import EngineConfig
from gateway.engine_view import EngineView
from gateway.kv_view import KVView
from gateway.live_seqs import LiveSeqs
from gateway.scheduler import Scheduler
from gateway.sequence import Sampling, Sequence
from gateway.step import ScheduledStep
from gateway.step_pace import StepPace
from gateway.step_runner import StepRunner
from tests.fake_cache import FakeCache

GREEDY = Sampling(max_tokens=8, temperature=0.0, top_p=1.0, top_k=0, seed=None, ignore_eos=False,
                  stop_token_ids=frozenset())  # fmt: skip
_clock = itertools.count()


def seq(name: str, prompt_len: int, priority: int = 0, n: int = 1, max_tokens: int = 0) -> Sequence:
    sampling = replace(GREEDY, n=n, max_tokens=max_tokens or GREEDY.max_tokens)
    return Sequence(seq_id=name, prompt_ids=list(range(prompt_len)), sampling=sampling, max_len=1024,
                    priority=priority, arrival=next(_clock))  # fmt: skip


def make(
    block_size: int,
    num_blocks: int,
    max_batched_tokens: int,
    max_seqs: int,
    prefill_tokens_with_decodes: int = 0,
    pace: StepPace | None = None,
    pace_streams: int = 1,
) -> Scheduler:
    """A scheduler over a fake cache; the token cap and the pace hold beside any number of decodes unless
    `pace_streams` says otherwise."""
    kv = KVView(FakeCache(num_blocks, block_size), block_size, num_blocks)
    return Scheduler(kv, max_batched_tokens, max_seqs, prefill_tokens_with_decodes, pace, pace_streams)


def step_runner(scheduler: Scheduler) -> StepRunner:
    """The engine's step runner over the scheduler, for its reserve stage (no compute, no lease)."""
    config = EngineConfig("", "", block_size=scheduler.kv.block_size)
    return StepRunner(None, scheduler, LiveSeqs(scheduler, scheduler.kv), None, EngineView(), None, config)


def run(scheduler: Scheduler, step: ScheduledStep) -> dict[str, int]:
    """What the engine does with a step: frees the preempted, or reserves the blocks, computes the chunks,
    forks samples and samples at the end of a prompt. Returns each scheduled sequence's chunk size."""
    kv = scheduler.kv
    if step.preempted:
        kv.free(step.preempted)
        return {}
    kv.reserve(step.seqs)
    for parent in [s for s in step.seqs if s.forks_now]:
        children = parent.fork()
        kv.fork(parent, children)
        scheduler.add_running(children)
    chunks = {}
    for s in step.seqs:
        chunks[s.seq_id] = s.chunk_len
        sampled = s.samples_now
        s.num_computed = s.chunk_end
        if sampled:
            s.output_ids.append(7)
    return chunks
