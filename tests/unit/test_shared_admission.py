"""Admission of prompts with prefix hits (a hit on a block a table holds, or one an earlier admission of
the step takes, costs no block; one on a cached block nobody holds costs one), the undo of admissions a
Reserve refused, and the prompt budget of a step with decodes. Over tests/fake_cache.py, whose Reserve
refuses (RESOURCE_EXHAUSTED) whatever does not fit."""

import pytest

from gateway.scheduler import Scheduler
from gateway.sequence import Status
from tests.fake_cache import RpcError
from tests.scheduling import make, run, seq, step_runner

BS = 16


def shared_pool(num_blocks: int, prefix_blocks: int, **limits) -> Scheduler:
    """A scheduler over a pool whose first `prefix_blocks` blocks cache every prompt's leading blocks."""
    scheduler = make(
        block_size=BS, num_blocks=num_blocks, **{"max_batched_tokens": 4096, "max_seqs": 8, **limits}
    )
    scheduler.kv._stub.cache_prefix(prefix_blocks)
    return scheduler


def look_up(scheduler: Scheduler) -> None:
    scheduler.kv.lookup(scheduler.unlooked(), scheduler.running)


def test_prompts_sharing_a_cached_prefix_are_admitted_together_by_the_blocks_they_add():
    scheduler = shared_pool(num_blocks=16, prefix_blocks=12)  # 4 free, 12 cached
    prompts = [seq(name, 12 * BS + 8) for name in "abcd"]  # 12 hits + 1 block each
    for prompt in prompts:
        scheduler.add(prompt)
    look_up(scheduler)
    assert [len(p.prefix_hit.blocks) for p in prompts] == [12] * 4
    step = scheduler.schedule()
    # a: 12 revived + 1; b and c: 1 each (their hits are a's); d: 1 would leave no watermark
    assert [s.seq_id for s in step.seqs] == ["a", "b", "c"]
    assert run(scheduler, step) == {"a": 8, "b": 8, "c": 8}, "only the tokens after the hits are computed"
    cache = scheduler.kv._stub
    assert scheduler.kv.available_blocks == cache.available == 1 == scheduler.watermark
    assert all(cache.refs[b] == 3 for b in cache.prefix), "the hits are shared, none copied"


def test_a_hit_on_a_block_nobody_holds_counts_as_taken():
    scheduler = shared_pool(num_blocks=14, prefix_blocks=12)  # 2 free
    long = seq("long", 12 * BS + 40)  # 12 hits + 3 new blocks: 15 > 14
    scheduler.add(long)
    look_up(scheduler)
    step = scheduler.schedule()
    assert run(scheduler, step) == {"long": 2 * BS}, "the chunk takes the 2 blocks the revived hits leave"
    assert scheduler.kv.available_blocks == 0


def test_hits_on_a_running_sequences_blocks_cost_nothing_where_the_whole_table_would_not_fit():
    scheduler = shared_pool(num_blocks=20, prefix_blocks=12)
    first, second = seq("first", 12 * BS + 8), seq("second", 12 * BS + 8)
    scheduler.add(first)
    look_up(scheduler)
    run(scheduler, scheduler.schedule())
    scheduler.add(second)
    look_up(scheduler)
    assert scheduler.kv.available_blocks == 7 < scheduler.kv.blocks_needed(second, 0) + 13
    step = scheduler.schedule()
    assert [s.seq_id for s in step.seqs] == ["first", "second"], "a decode, then the new prompt"
    assert run(scheduler, step) == {"first": 1, "second": 8}


def test_the_lookup_carries_the_running_progress_so_a_prompt_finds_what_the_last_step_wrote():
    scheduler = make(block_size=BS, num_blocks=64, max_batched_tokens=64, max_seqs=8)
    first = seq("first", 200)
    scheduler.add(first)
    scheduler.kv.lookup(scheduler.unlooked())
    run(scheduler, scheduler.schedule())
    scheduler.add(seq("second", 200))
    scheduler.kv.lookup(scheduler.unlooked(), scheduler.running)
    assert scheduler.kv._stub.progress == {"first": 64}


def test_waiting_prompts_look_their_prefix_up_again_after_a_step_with_prompt_chunks():
    scheduler = make(block_size=BS, num_blocks=64, max_batched_tokens=64, max_seqs=8)
    first, second = seq("first", 40), seq("second", 88)
    scheduler.add(first)
    scheduler.add(second)
    scheduler.kv.lookup(scheduler.unlooked())
    assert run(scheduler, scheduler.schedule()) == {"first": 40, "second": 24}
    scheduler.add(third := seq("third", 40))
    scheduler.kv.lookup(scheduler.unlooked())
    assert third.prefix_hit.tokens == 0
    scheduler.max_seqs = 2
    assert run(scheduler, scheduler.schedule()) == {"first": 1, "second": 63}
    assert third.prefix_hit is None, "the step computed prompt tokens: the hint may be stale"
    assert scheduler.unlooked() == [third]
    scheduler.kv.lookup(scheduler.unlooked())
    assert run(scheduler, scheduler.schedule()) == {"first": 1, "second": 1}
    assert third.prefix_hit.tokens == 0, "a step of decodes alone keeps the hints"


def test_a_reserve_refused_for_blocks_undoes_the_new_admissions_and_runs_the_rest():
    scheduler = shared_pool(num_blocks=20, prefix_blocks=12)
    first, late = seq("first", 12 * BS + 8), seq("late", 12 * BS + 40)
    scheduler.add(first)
    look_up(scheduler)
    run(scheduler, scheduler.schedule())
    cache = scheduler.kv._stub
    scheduler.add(late)
    look_up(scheduler)
    stolen = [cache.free.pop() for _ in range(5)]  # taken behind the view's back: its counts are stale
    step = scheduler.schedule()
    assert step.seqs == [first, late]
    step_runner(scheduler).reserve(step, news=True)
    assert step.seqs == [first], "the step runs what fits"
    assert late.status is Status.WAITING and scheduler.waiting == [late] and late.prefix_hit is None
    assert not scheduler.kv.holds(late) and "late" not in cache.tables, "the refused Reserve took nothing"
    assert all(cache.refs[b] == 1 for b in cache.prefix), "no reference leaked"
    cache.free.extend(stolen)
    look_up(scheduler)
    assert scheduler.schedule().seqs == [first, late], "admitted again once the blocks are there"


def test_a_refused_reserve_of_running_sequences_alone_still_fails_the_step():
    scheduler = shared_pool(num_blocks=14, prefix_blocks=12)
    first = seq("first", 12 * BS + 16)  # its first decode needs a new block
    scheduler.add(first)
    look_up(scheduler)
    run(scheduler, scheduler.schedule())
    scheduler.kv._stub.free.clear()
    step = scheduler.schedule()
    with pytest.raises(Exception, match="RESOURCE_EXHAUSTED") as raised:
        step_runner(scheduler).reserve(step, news=True)
    assert isinstance(raised.value.err, RpcError) and scheduler.running == [first]


def test_with_decodes_running_a_step_takes_at_most_the_prefill_cap_of_prompt_tokens():
    scheduler = make(
        block_size=BS, num_blocks=200, max_batched_tokens=1000, max_seqs=8, prefill_tokens_with_decodes=96
    )
    scheduler.add(seq("alone", 900))
    assert run(scheduler, scheduler.schedule()) == {"alone": 900}, "no decode: the whole budget"
    scheduler.add(seq("a", 100))
    scheduler.add(seq("b", 100))
    assert run(scheduler, scheduler.schedule()) == {"alone": 1, "a": 96}, "a decode: 96 prompt tokens"
    assert run(scheduler, scheduler.schedule()) == {"alone": 1, "a": 4, "b": 92}
    assert run(scheduler, scheduler.schedule()) == {"alone": 1, "a": 1, "b": 8}
