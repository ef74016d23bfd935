from gateway.scheduler import Scheduler
from gateway.sequence import Sampling, Sequence, Status

GREEDY = Sampling(max_tokens=8, temperature=0.0, top_p=1.0, top_k=0, seed=None, ignore_eos=False,
                  stop_token_ids=frozenset())  # fmt: skip


def seq(name: str, prompt_len: int) -> Sequence:
    return Sequence(seq_id=name, prompt_ids=list(range(prompt_len)), sampling=GREEDY, max_len=1024)


def run_prefill(scheduler: Scheduler, step) -> None:
    """What the engine does after a prefill: tables allocated, prompt computed, one token sampled."""
    for s in step.seqs:
        need = scheduler.blocks_needed(s)
        s.block_table += list(range(need))
        scheduler.free_blocks -= need
        s.num_computed = s.num_tokens
        s.output_ids.append(7)


def test_prefill_packs_waiting_prompts_fcfs_under_the_token_budget():
    scheduler = Scheduler(block_size=16, num_blocks=100, max_batched_tokens=100, max_seqs=8)
    for name, n in (("a", 40), ("b", 50), ("c", 30), ("d", 5)):
        scheduler.add(seq(name, n))
    step = scheduler.schedule()
    assert step.is_prefill
    assert [s.seq_id for s in step.seqs] == ["a", "b"], "c would pass the budget and d may not overtake it"
    assert [s.seq_id for s in scheduler.waiting] == ["c", "d"]


def test_a_prompt_longer_than_the_budget_runs_alone():
    scheduler = Scheduler(block_size=16, num_blocks=100, max_batched_tokens=64, max_seqs=8)
    scheduler.add(seq("long", 300))
    assert [s.seq_id for s in scheduler.schedule().seqs] == ["long"]


def test_admission_waits_for_free_blocks():
    scheduler = Scheduler(block_size=16, num_blocks=4, max_batched_tokens=1000, max_seqs=8)
    scheduler.add(seq("a", 40))
    scheduler.add(seq("b", 40))
    step = scheduler.schedule()
    assert [s.seq_id for s in step.seqs] == ["a"], "b needs 3 blocks, 1 is left"
    run_prefill(scheduler, step)
    decode = scheduler.schedule()
    assert not decode.is_prefill and [s.seq_id for s in decode.seqs] == ["a"]


def test_decode_preempts_the_latest_sequence_when_blocks_run_out():
    scheduler = Scheduler(block_size=4, num_blocks=4, max_batched_tokens=1000, max_seqs=8)
    scheduler.add(seq("old", 3))
    scheduler.add(seq("new", 3))
    run_prefill(scheduler, scheduler.schedule())
    assert scheduler.free_blocks == 2
    for _ in range(5):  # both grow to 9 tokens: a third block each, with the pool full
        step = scheduler.schedule()
        for s in step.seqs:
            need = scheduler.blocks_needed(s)
            s.block_table += [0] * need
            scheduler.free_blocks -= need
            s.num_computed = s.num_tokens
            s.output_ids.append(7)
    assert scheduler.free_blocks == 0
    step = scheduler.schedule()
    assert [s.seq_id for s in step.preempted] == ["new"]
    assert [s.seq_id for s in step.seqs] == ["old"]
    victim = step.preempted[0]
    assert victim.status is Status.WAITING and victim.block_table == [] and victim.num_computed == 0
    assert len(victim.output_ids) == 6, "tokens are kept for the recompute"
    assert scheduler.waiting[0] is victim
    assert scheduler.num_preemptions == 1


def test_remove_takes_a_sequence_out_of_either_queue():
    scheduler = Scheduler(block_size=16, num_blocks=10, max_batched_tokens=1000, max_seqs=1)
    a, b = seq("a", 4), seq("b", 4)
    scheduler.add(a)
    scheduler.add(b)
    scheduler.schedule()
    scheduler.remove(a)
    scheduler.remove(b)
    assert not scheduler.has_work()
    assert a.status is b.status is Status.FINISHED


def test_a_forked_sequence_reserves_a_block_for_its_copy_on_write():
    scheduler = Scheduler(block_size=4, num_blocks=4, max_batched_tokens=1000, max_seqs=8)
    parent = seq("p", 6)
    scheduler.add(parent)
    run_prefill(scheduler, scheduler.schedule())
    assert scheduler.blocks_needed(parent) == 0, "7 tokens fit in its 2 blocks"
    parent.shares_tail = True
    assert scheduler.blocks_needed(parent) == 1, "its tail block is shared: the next write copies it"
