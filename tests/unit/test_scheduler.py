"""The gateway's scheduler: chunked prefill, admission, preemption, priorities, forks."""

from gateway.sequence import Status
from tests.scheduling import make, run, seq, step_runner


def test_a_long_prompt_is_prefilled_in_chunks_and_samples_only_at_its_end():
    scheduler = make(block_size=16, num_blocks=100, max_batched_tokens=64, max_seqs=8)
    long = seq("long", 300)
    scheduler.add(long)
    sizes = []
    while not long.output_ids:
        step = scheduler.schedule()
        assert [s.seq_id for s in step.seqs] == ["long"]
        assert step.seqs[0].samples_now == (step.seqs[0].chunk_end == 300)
        sizes.append(run(scheduler, step)["long"])
    assert sizes == [64, 64, 64, 64, 44]


def test_a_step_mixes_decodes_first_then_a_chunk_under_the_budget():
    scheduler = make(block_size=16, num_blocks=100, max_batched_tokens=32, max_seqs=8)
    for name in ("a", "b"):
        scheduler.add(seq(name, 8))
    run(scheduler, scheduler.schedule())
    scheduler.add(seq("c", 100))
    step = scheduler.schedule()
    assert [s.seq_id for s in step.seqs] == ["a", "b", "c"], "decodes first"
    assert run(scheduler, step) == {"a": 1, "b": 1, "c": 30}
    step = scheduler.schedule()
    assert run(scheduler, step) == {"a": 1, "b": 1, "c": 30}, "the partly computed prompt goes on"


def test_waiting_prompts_are_packed_in_arrival_order_and_none_overtakes():
    scheduler = make(block_size=16, num_blocks=100, max_batched_tokens=100, max_seqs=8)
    for name, n in (("a", 40), ("b", 50), ("c", 30), ("d", 5)):
        scheduler.add(seq(name, n))
    step = scheduler.schedule()
    assert run(scheduler, step) == {"a": 40, "b": 50, "c": 10}, "c gets what is left of the budget"
    assert [s.seq_id for s in scheduler.waiting] == ["d"]


def test_lower_priority_value_is_admitted_first_then_arrival_order():
    scheduler = make(block_size=16, num_blocks=100, max_batched_tokens=16, max_seqs=8)
    for name, priority in (("late-low", 5), ("first", 0), ("urgent", -1), ("second", 0)):
        scheduler.add(seq(name, 16, priority))
    order = []
    for _ in range(4):
        (admitted,) = scheduler.schedule().seqs
        order.append(admitted.seq_id)
        scheduler.remove(admitted)
    assert order == ["urgent", "first", "second", "late-low"]


def test_admission_waits_for_the_blocks_of_the_first_chunk():
    scheduler = make(block_size=16, num_blocks=4, max_batched_tokens=1000, max_seqs=8)
    scheduler.add(seq("a", 40))
    scheduler.add(seq("b", 40))
    step = scheduler.schedule()
    assert run(scheduler, step) == {"a": 40}, "b can have 1 block but the watermark keeps it for a"
    step = scheduler.schedule()
    assert [s.seq_id for s in step.seqs] == ["a"] and scheduler.waiting[0].seq_id == "b"


def test_blocks_running_out_preempt_the_latest_arrival_keeping_its_progress():
    scheduler = make(block_size=4, num_blocks=4, max_batched_tokens=1000, max_seqs=8)
    old, new = seq("old", 3), seq("new", 3)
    scheduler.add(old)
    scheduler.add(new)
    run(scheduler, scheduler.schedule())
    while not (step := scheduler.schedule()).preempted:
        run(scheduler, step)
    kv = scheduler.kv
    assert kv.available_blocks == 0 and len(kv.block_table(old)) == len(kv.block_table(new)) == 2
    assert step.seqs == [] and step.preempted == [new]
    assert new.status is Status.WAITING and new.num_computed > 0, "freed with its progress, for prefix hits"
    assert scheduler.num_preemptions == 1
    tokens = list(new.token_ids)
    run(scheduler, step)
    assert not kv.holds(new) and new.num_computed == 0 and new.token_ids == tokens
    assert [s.seq_id for s in scheduler.schedule().seqs] == ["old"]


def test_a_preempted_sequence_waits_until_its_whole_context_fits():
    scheduler = make(block_size=4, num_blocks=8, max_batched_tokens=4, max_seqs=8)
    old, new = seq("old", 12), seq("new", 8)
    scheduler.add(old)
    run(scheduler, scheduler.schedule())
    scheduler.add(new)
    while not (step := scheduler.schedule()).preempted:
        run(scheduler, step)
    assert step.preempted == [new]
    run(scheduler, step)
    room = scheduler.kv.available_blocks - scheduler.watermark
    assert 1 <= room < scheduler.kv.blocks_needed(new, new.num_tokens), "a chunk of it fits, not all of it"
    assert scheduler.schedule().seqs == [old]
    scheduler.remove(old)
    scheduler.kv.release([old])
    assert scheduler.schedule().seqs == [new]


def test_the_victim_is_the_lowest_priority_even_if_it_arrived_first():
    scheduler = make(block_size=4, num_blocks=6, max_batched_tokens=1000, max_seqs=8)
    background, a, b = seq("background", 7, priority=3), seq("a", 3), seq("b", 3)
    for s in (background, a, b):
        scheduler.add(s)
    run(scheduler, scheduler.schedule())
    while not (step := scheduler.schedule()).preempted:
        run(scheduler, step)
    assert step.preempted == [background]
    run(scheduler, step)
    scheduler.remove(background)
    while not (step := scheduler.schedule()).preempted:
        run(scheduler, step)
    assert step.preempted == [b], "among equal priorities the latest arrival goes"


def test_samples_of_n_take_their_slots_before_they_fork():
    scheduler = make(block_size=16, num_blocks=100, max_batched_tokens=1000, max_seqs=4)
    scheduler.add(seq("three", 8, n=3))
    scheduler.add(seq("two", 8, n=2))
    scheduler.add(seq("one", 8))
    step = scheduler.schedule()
    assert [s.seq_id for s in step.seqs] == ["three"], "two more samples would make 5 > max_seqs"
    assert sum(s.num_slots for s in scheduler.running) == 3


def test_a_request_may_take_every_slot_when_nothing_runs():
    scheduler = make(block_size=16, num_blocks=100, max_batched_tokens=1000, max_seqs=4)
    scheduler.add(seq("four", 8, n=4))
    assert [s.seq_id for s in scheduler.schedule().seqs] == ["four"]


def test_remove_takes_a_sequence_out_of_either_queue():
    scheduler = make(block_size=16, num_blocks=10, max_batched_tokens=1000, max_seqs=1)
    a, b = seq("a", 4), seq("b", 4)
    scheduler.add(a)
    scheduler.add(b)
    scheduler.schedule()
    scheduler.remove(a)
    scheduler.remove(b)
    assert not scheduler.has_work()
    assert a.status is b.status is Status.FINISHED


def test_a_forked_sequence_reserves_a_block_for_its_copy_on_write():
    scheduler = make(block_size=4, num_blocks=8, max_batched_tokens=1000, max_seqs=8)
    single, parent = seq("s", 6), seq("p", 6, n=2)
    scheduler.add(single)
    scheduler.add(parent)
    run(scheduler, scheduler.schedule())
    kv, (child,) = scheduler.kv, [s for s in scheduler.running if s.index == 1]
    assert (
        child.seq_id == "p/1" and child.num_computed == 5 and kv.block_table(child) == kv.block_table(parent)
    )
    assert kv.blocks_needed(single, 7) == 0, "7 tokens fit in its 2 blocks"
    assert kv.blocks_needed(parent, 7) == 1, "its tail block is shared: the next write copies it"
    assert kv.blocks_needed(child, 6) == 1
    step = scheduler.schedule()
    assert step.seqs == [single, parent, child]
    run(scheduler, step)
    assert kv.block_table(child)[0] == kv.block_table(parent)[0], "the prefix block stays shared"
    assert kv.block_table(child)[1] != kv.block_table(parent)[1], "the written one was copied"
    assert kv.blocks_needed(parent, 8) == 0 and kv.available_blocks == 8 - 5


def test_a_cached_prefix_costs_no_budget_and_its_first_chunk_starts_after_it():
    scheduler = make(block_size=16, num_blocks=100, max_batched_tokens=64, max_seqs=8)
    scheduler.kv._stub.cached_prefix = 200
    busy, shared = seq("busy", 40), seq("shared", 300)
    scheduler.add(busy)
    scheduler.add(shared)
    assert [s.seq_id for s in scheduler.unlooked()] == ["busy", "shared"]
    scheduler.kv.lookup(scheduler.unlooked())
    hits = (busy.prefix_hit.tokens, shared.prefix_hit.tokens)
    assert hits == (32, 192), "whole blocks, never the last token"
    assert scheduler.unlooked() == []
    step = scheduler.schedule()
    assert (busy.chunk_end, shared.chunk_end) == (40, 192 + 56), "busy's 8 new tokens, then 56 after the hits"
    assert run(scheduler, step) == {"busy": 8, "shared": 56}
    assert (shared.cached_tokens, shared.num_computed) == (192, 248)


def test_a_stale_prefix_hint_costs_neither_budget_nor_blocks():
    scheduler = make(block_size=16, num_blocks=100, max_batched_tokens=64, max_seqs=8)
    cache = scheduler.kv._stub
    cache.cached_prefix = 200
    shared = seq("shared", 300)
    scheduler.add(shared)
    scheduler.kv.lookup(scheduler.unlooked())
    cache.cached_prefix = 32  # evicted since the Lookup
    step = scheduler.schedule()
    planned = scheduler.kv.blocks_needed(shared, shared.chunk_end)
    free = len(cache.free)
    assert run(scheduler, step) == {"shared": 64}, "the Reserve capped the tokens computed after the hits"
    assert shared.cached_tokens == 32 and free - len(cache.free) <= planned


def test_a_preempted_sequence_looks_its_prefix_up_again():
    scheduler = make(block_size=16, num_blocks=100, max_batched_tokens=64, max_seqs=8)
    a = seq("a", 40)
    scheduler.add(a)
    scheduler.kv.lookup(scheduler.unlooked())
    run(scheduler, scheduler.schedule())
    scheduler.kv.free([a])
    assert a.prefix_hit is None and a.num_computed == 0


def test_a_multi_step_call_halves_its_steps_until_their_blocks_fit():
    """Two decoding sequences of 8 tokens in a pool of 16 blocks of 4, too few for 32 more tokens each: the
    call takes the most steps (32 halved) whose blocks fit above the watermark, and one step while a
    request waits or is new."""
    scheduler = make(block_size=4, num_blocks=16, max_batched_tokens=64, max_seqs=8)
    for name in ("a", "b"):
        scheduler.add(seq(name, 8, max_tokens=100))
    run(scheduler, scheduler.schedule())
    step = scheduler.schedule()
    assert all(s.is_decode for s in step.seqs) and len(step.seqs) == 2
    kv = scheduler.kv
    room = kv.available_blocks - scheduler.watermark
    need = {n: sum(kv.blocks_needed(s, s.chunk_end + n - 1) for s in step.seqs) for n in (32, 16, 8, 4)}
    fitting = max(n for n, blocks in need.items() if blocks <= room)
    assert need[32] > room and fitting < 32, "the pool is too small for every step count"
    assert scheduler.multi_steps(step, 32, news=False) == fitting
    assert scheduler.multi_steps(step, fitting, news=False) == fitting
    assert scheduler.multi_steps(step, 32, news=True) == 1
    scheduler.add(seq("c", 4))
    assert scheduler.multi_steps(step, 32, news=False) == 1, "a waiting request keeps the lookahead room"


def test_a_multi_step_call_holds_no_slot_past_what_its_rows_may_still_sample():
    """Rows with 3 tokens left in a call of 32 steps: their tables grow by the 2 later steps' slots, not
    31, so the lookahead evicts no cached prefix for tokens no step can write."""
    scheduler = make(block_size=4, num_blocks=64, max_batched_tokens=64, max_seqs=8)
    for name in ("a", "b"):
        scheduler.add(seq(name, 8, max_tokens=4))
    run(scheduler, scheduler.schedule())
    step = scheduler.schedule()
    assert all(s.is_decode and s.tokens_left == 3 for s in step.seqs)
    assert scheduler.multi_steps(step, 32, news=False) == 32
    available = scheduler.kv.available_blocks
    step_runner(scheduler).reserve(step, news=False)
    assert step.num_steps == 32
    assert [len(table) for table in scheduler.kv.step_tables(step.seqs)[0]] == [3, 3], "slots to 8 + 1 + 2"
    assert available - scheduler.kv.available_blocks == 2
