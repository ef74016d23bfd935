"""Prompt chunks sized by time beside decodes: the fit of step times (fed synthetic steps) and the chunk
the scheduler gives a step that runs decodes."""

import random

import pytest

from gateway.step_pace import MIN_PROMPT_TOKENS, WARMUP, StepCost, StepPace, StepShape, chunk_pairs
from tests.scheduling import make, run, seq

# A 16-sequence decode batch at 256 tokens of context.
DECODES = StepShape(16, 16 * 257)
# A machine: 20 ms a step, 1 ms a token, 20 ns an attention pair.
MACHINE = StepCost(fixed=0.020, per_token=1e-3, per_pair=2e-8)


def mixed(chunk: int, start: int = 0) -> StepShape:
    """DECODES plus a prompt chunk of `chunk` tokens from `start`."""
    return StepShape(DECODES.tokens + chunk, DECODES.pairs + chunk_pairs(start, chunk))


def feed(pace: StepPace, machine: StepCost, steps: int, seed: int = 0, jitter: float = 0.05) -> None:
    """`steps` steps timed on `machine` (±jitter): decode-only steps and mixed ones of the chunk the pace
    gives (the cap of 512 until it gives one), as a scheduler would run them."""
    rng = random.Random(seed)
    for i in range(steps):
        chunk = 0 if i % 3 == 0 else min(512, pace.prompt_tokens(DECODES, 0) or 512)
        shape = mixed(chunk, start=rng.choice((0, 512, 1024)) if chunk else 0)
        pace.observe(shape, machine.seconds(shape) * (1 + rng.uniform(-jitter, jitter)))


def largest_within(machine: StepCost, target_s: float, start: int = 0) -> int:
    """The largest chunk the machine runs beside DECODES within target_s."""
    n = 0
    while machine.seconds(mixed(n + 1, start)) <= target_s:
        n += 1
    return n


def test_the_fit_learns_the_machine_from_its_steps():
    pace = StepPace(0.2)
    feed(pace, MACHINE, 60)
    cost = pace.fit.cost
    assert cost.fixed == pytest.approx(MACHINE.fixed, rel=0.3)
    assert cost.per_token == pytest.approx(MACHINE.per_token, rel=0.1)
    assert cost.seconds(mixed(300, 1024)) == pytest.approx(MACHINE.seconds(mixed(300, 1024)), rel=0.05)


def test_the_chunk_keeps_the_step_within_its_target():
    pace = StepPace(0.2)
    feed(pace, MACHINE, 60)
    best = largest_within(MACHINE, 0.2)
    assert 100 < best < 512, "the target binds below the cap, above the minimum"
    assert 0.9 * best <= pace.prompt_tokens(DECODES, 0) <= 1.05 * best


def test_context_the_chunk_attends_over_shrinks_it():
    pace = StepPace(0.2)
    machine = StepCost(fixed=0.020, per_token=4e-4, per_pair=1e-7)
    feed(pace, machine, 90)
    near, far = pace.prompt_tokens(DECODES, 0), pace.prompt_tokens(DECODES, 4096)
    assert far < 0.8 * near
    assert 0.85 * largest_within(machine, 0.2, 4096) <= far <= 1.1 * largest_within(machine, 0.2, 4096)


def test_before_any_step_the_pace_leaves_the_token_cap_alone():
    assert StepPace(0.2).prompt_tokens(DECODES, 0) is None


def test_a_new_stacks_first_prompt_step_already_sizes_the_chunks_within_the_target():
    """A burst on a new stack: the first step is one prompt alone; the steps after it run its decode beside
    the next prompts, and must not wait for WARMUP steps to keep within the target."""
    pace = StepPace(0.2)
    first = StepShape(575, chunk_pairs(0, 575))
    pace.observe(first, MACHINE.seconds(first))
    chunk = pace.prompt_tokens(DECODES, 0)
    # NOTE: about the target: one step cannot tell a step's fixed cost from its tokens' cost
    assert MACHINE.seconds(mixed(chunk)) <= 1.1 * 0.2, "within the target from the second step"
    assert chunk >= 0.7 * largest_within(MACHINE, 0.2), "and not far below it"
    for _ in range(WARMUP - 2):
        pace.observe(mixed(chunk), MACHINE.seconds(mixed(chunk)))
        chunk = pace.prompt_tokens(DECODES, 0)
        assert MACHINE.seconds(mixed(chunk)) <= 1.1 * 0.2 and pace.fit.seen < WARMUP


def test_decodes_slower_than_the_target_still_let_the_minimum_chunk_in():
    pace = StepPace(0.010)
    feed(pace, MACHINE, 60)
    assert MACHINE.seconds(DECODES) > 0.010
    assert pace.prompt_tokens(DECODES, 0) == MIN_PROMPT_TOKENS


def test_a_machine_that_slows_down_is_followed():
    pace = StepPace(0.2)
    feed(pace, MACHINE, 60)
    before = pace.prompt_tokens(DECODES, 0)
    slow = StepCost(fixed=0.040, per_token=2e-3, per_pair=4e-8)
    feed(pace, slow, 60, seed=1)
    after = pace.prompt_tokens(DECODES, 0)
    assert after < 0.6 * before
    assert 0.85 * largest_within(slow, 0.2) <= after <= 1.1 * largest_within(slow, 0.2)


def test_one_slow_step_moves_the_chunk_a_little_and_is_forgotten():
    pace = StepPace(0.2)
    feed(pace, MACHINE, 60)
    before = pace.prompt_tokens(DECODES, 0)
    pace.observe(mixed(before), 100 * MACHINE.seconds(mixed(before)))
    assert pace.prompt_tokens(DECODES, 0) >= 0.6 * before, "one outlier is clipped"
    feed(pace, MACHINE, 60, seed=2)
    assert pace.prompt_tokens(DECODES, 0) == pytest.approx(before, rel=0.05)


def test_a_fit_that_turns_unphysical_keeps_pacing_with_the_last_physical_one():
    """Steps whose times fall as their tokens grow (noise on a loaded host, a model too small to tell) would
    make a token cost nothing: the pace keeps the last physical fit instead of letting the cap in."""
    pace = StepPace(0.2)
    feed(pace, MACHINE, 60)
    for i in range(300):
        shape = StepShape(16 + 64 * (i % 8), 0)
        pace.observe(shape, 0.5 - 1e-3 * shape.tokens)
    assert pace.fit._solve() is None, "the steps fed make the fit unphysical"
    assert pace.fit.cost is not None and pace.fit.cost.per_token > 0
    assert pace.prompt_tokens(DECODES, 0) is not None, "paced, not left to the cap"


def test_decodes_only_cannot_mislead_the_chunk_below_its_cap():
    """Steps that never vary tell nothing of a prompt token's cost: the pace's chunk is then large (the
    cap holds), and the first mixed steps correct it."""
    pace = StepPace(0.2)
    for _ in range(30):
        pace.observe(DECODES, MACHINE.seconds(DECODES))
    assert pace.prompt_tokens(DECODES, 0) is None or pace.prompt_tokens(DECODES, 0) >= 512
    feed(pace, MACHINE, 30)
    assert pace.prompt_tokens(DECODES, 0) <= 1.1 * largest_within(MACHINE, 0.2)


def trained(target_s: float) -> StepPace:
    pace = StepPace(target_s)
    rng = random.Random(3)
    for i in range(40):
        decodes, chunk = rng.randint(1, 4), 0 if i % 2 else rng.randint(16, 400)
        shape = StepShape(decodes + chunk, decodes * 40 + chunk_pairs(0, chunk))
        pace.observe(shape, MACHINE.seconds(shape))
    return pace


def decoding_scheduler(pace: StepPace | None, cap: int):
    """Two sequences decoding, a long prompt waiting."""
    scheduler = make(16, 200, max_batched_tokens=2048, max_seqs=8, prefill_tokens_with_decodes=cap, pace=pace)
    for name in ("a", "b"):
        scheduler.add(seq(name, 20))
    run(scheduler, scheduler.schedule())
    scheduler.add(seq("long", 1500))
    return scheduler


def test_the_scheduler_gives_a_step_with_decodes_the_paced_chunk():
    pace = trained(0.2)
    scheduler = decoding_scheduler(pace, cap=512)
    chunks = run(scheduler, scheduler.schedule())
    assert chunks["a"] == chunks["b"] == 1
    paced = pace.prompt_tokens(StepShape(2, 2 * 21), 0)
    assert chunks["long"] == paced < 512
    assert MACHINE.seconds(StepShape(2 + paced, 42 + chunk_pairs(0, paced))) <= 0.2 * 1.05
    chunks = run(scheduler, scheduler.schedule())
    assert chunks["long"] == pace.prompt_tokens(StepShape(2, 2 * 22), paced), "the next chunk, from where"


def test_the_token_cap_bounds_the_paced_chunk():
    scheduler = decoding_scheduler(trained(5.0), cap=128)
    assert run(scheduler, scheduler.schedule())["long"] == 128


def test_a_step_without_decodes_takes_the_whole_budget():
    scheduler = make(16, 200, max_batched_tokens=1024, max_seqs=8, prefill_tokens_with_decodes=512,
                     pace=trained(0.05))  # fmt: skip
    scheduler.add(seq("long", 1500))
    assert run(scheduler, scheduler.schedule()) == {"long": 1024}


def test_without_a_pace_the_token_cap_alone_sizes_the_chunk():
    scheduler = decoding_scheduler(None, cap=300)
    assert run(scheduler, scheduler.schedule())["long"] == 300


def lone_stream_scheduler(pace: StepPace | None, cap: int, pace_streams: int, decoding: int = 1):
    """`decoding` sequences decoding, a burst of ten 100-token prompts waiting."""
    scheduler = make(16, 400, max_batched_tokens=4096, max_seqs=16, prefill_tokens_with_decodes=cap,
                     pace=pace, pace_streams=pace_streams)  # fmt: skip
    for i in range(decoding):
        scheduler.add(seq(f"running{i}", 20))
    run(scheduler, scheduler.schedule())
    for i in range(10):
        scheduler.add(seq(f"burst{i}", 100))
    return scheduler


def prompt_tokens(chunks: dict[str, int]) -> int:
    return sum(n for name, n in chunks.items() if name.startswith("burst"))


def test_beside_fewer_streams_than_pace_streams_the_token_cap_stretches():
    # one stream decoding: 4 / 1 times the cap of 128; two: 4 / 2 times; four or more: the cap as given
    for decoding, expected in ((1, 512), (2, 256), (4, 128), (6, 128)):
        scheduler = lone_stream_scheduler(None, cap=128, pace_streams=4, decoding=decoding)
        assert prompt_tokens(run(scheduler, scheduler.schedule())) == expected, decoding


def test_beside_fewer_streams_than_pace_streams_the_target_stretches():
    pace = trained(0.2)
    scheduler = lone_stream_scheduler(pace, cap=4096, pace_streams=4)
    chunks = run(scheduler, scheduler.schedule())
    assert chunks["running0"] == 1
    stretched = pace.prompt_tokens(StepShape(1, 21), 0, stretch=4.0)
    assert stretched > pace.prompt_tokens(StepShape(1, 21), 0)
    # the burst's prompts are admitted in order while the stretched chunk lasts: 100 tokens each
    assert prompt_tokens(chunks) == min(1000, stretched)
    assert MACHINE.seconds(StepShape(1 + prompt_tokens(chunks), 21)) <= 4 * 0.2 * 1.1


def test_pace_streams_one_holds_the_cap_and_target_beside_a_lone_stream():
    scheduler = lone_stream_scheduler(None, cap=128, pace_streams=1)
    assert prompt_tokens(run(scheduler, scheduler.schedule())) == 128
    pace = trained(0.2)
    scheduler = lone_stream_scheduler(pace, cap=4096, pace_streams=1)
    assert prompt_tokens(run(scheduler, scheduler.schedule())) <= pace.prompt_tokens(StepShape(1, 21), 0)
