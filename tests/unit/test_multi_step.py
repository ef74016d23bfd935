"""Multi-step decode in the gateway (gateway/scheduler.py, step_request.py, executor.py) over the fake
peers: the same tokens as one Forward per step, fewer calls, a call ended early by news, a stop string's
blocks held until the call is over; and the compute side's plan (compute_service/multi_step.py)."""

import threading
import time
from dataclasses import fields, replace

import pytest
import torch

from common.errors import InvalidArgument, RowsRefused
from compute_service.batch import ForwardBatch
from compute_service.multi_step import MultiStepPlan
from compute_service.validation import Limits
from gateway.executor import select_rows
from gateway.sequence import Sampling, Sequence
from gateway.step_deadline import ReplyDeadline
from gateway.step_request import RowLimit, row_limit
from protos import compute_pb2
from tests.fake_engine import BLOCKS, GREEDY, PROMPTS, collect, run_all, start, submit, tokenizer
from tests.forward import forward_request

__all__ = ["start", "tokenizer"]  # fixtures


def test_steps_in_one_call_give_the_tokens_of_one_call_per_step(start):
    engine, cache, compute = start(decode_steps=1)
    single = run_all(engine)
    assert compute.call_steps == []
    engine, cache, compute = start(decode_steps=8)
    assert run_all(engine) == single
    # 3 prompts × 11 decode steps after the first token: at most a few calls, each of several steps
    assert 2 <= len(compute.call_steps) <= 8 and max(compute.call_steps) == 8, compute.call_steps
    assert cache.tables == {} and len(cache.free) == BLOCKS


def test_a_new_request_ends_the_running_call_after_its_step(start):
    engine, _, compute = start(decode_steps=1)
    long = replace(GREEDY, max_tokens=30)
    expected = [collect(_submit(engine, PROMPTS[0], long)), collect(submit(engine, PROMPTS[1]))]
    engine, cache, compute = start(decode_steps=64)
    first = _submit(engine, PROMPTS[0], long)
    later = []
    # the 5th step runs inside the first request's call: a request arriving then is scheduled right after
    compute.before[5] = lambda: later.append(submit(engine, PROMPTS[1]))
    assert collect(first) == expected[0]
    assert collect(later[0]) == expected[1]
    assert compute.call_steps[0] <= 5, compute.call_steps
    assert cache.tables == {} and len(cache.free) == BLOCKS


def test_a_stop_string_ends_the_call_and_its_blocks_are_freed_only_after_it(start, tokenizer):
    engine, _, _ = start(decode_steps=1)
    sampling = replace(GREEDY, max_tokens=40)
    text = tokenizer.decode(collect(_submit(engine, PROMPTS[2], sampling)), skip_special_tokens=True)
    # a stop string the text reaches half way: the request ends there, with one Forward per step as well
    stop = replace(sampling, stop=(text[len(text) // 2 : len(text) // 2 + 3],))
    expected = collect(_submit(engine, PROMPTS[2], stop))
    assert 4 < len(expected) < 40, (text, stop.stop)
    engine, cache, compute = start(decode_steps=16)
    in_call, frees = [], []
    compute.before.update({n: (lambda: in_call.append(True)) for n in range(1, 60)})
    free = cache.Free

    def recorded_free(request, **kw):
        frees.append((list(request.seq_ids), len(in_call)))
        return free(request, **kw)

    cache.Free = recorded_free
    seq = _submit(engine, PROMPTS[2], stop)
    assert collect(seq) == expected and seq.finish_reason == "stop"
    _wait_idle(engine)
    # compute may run the row on after the gateway ended it: its Free comes once that call has ended
    steps_before_free = next(steps for ids, steps in frees if seq.seq_id in ids)
    assert steps_before_free == compute.forwards == 1 + sum(compute.call_steps), (frees, compute.call_steps)
    assert sum(compute.call_steps) >= len(expected) - 1
    assert cache.tables == {} and len(cache.free) == BLOCKS


def _wait_idle(engine, timeout: float = 10.0) -> None:
    """Until the engine has no call running and nothing to schedule."""
    deadline = time.monotonic() + timeout
    while engine.runner.executor.in_call or engine.scheduler.has_work():
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.01)


def _submit(engine, prompt: list[int], sampling: Sampling) -> Sequence:
    seq = Sequence(seq_id=f"t{id(sampling)}-{prompt[0]}", prompt_ids=prompt, sampling=sampling, max_len=512,
                   request_id=str(prompt[0]))  # fmt: skip
    engine.submit(seq)
    return seq


def test_a_row_limit_keeps_to_max_tokens_the_model_length_and_its_stop_ids():
    seq = Sequence("s", [1] * 10, Sampling(max_tokens=5, stop_token_ids=frozenset({7})), max_len=14)
    seq.output_ids = [4, 4]
    assert row_limit(seq, 8, frozenset({2})) == RowLimit(2, frozenset({2, 7}))  # 14 - 12 tokens left
    seq.max_len = 512
    assert row_limit(seq, 8, frozenset({2})).max_steps == 3  # 5 - 2 tokens to max_tokens
    seq.sampling = replace(seq.sampling, ignore_eos=True, max_tokens=100)
    assert row_limit(seq, 8, frozenset({2})) == RowLimit(8, frozenset({7}))


def test_select_rows_keeps_the_tokens_and_top_logprobs_of_the_kept_rows():
    asks = [Sampling(logprobs=2), Sampling(), Sampling(logprobs=1)]
    seqs = [Sequence(f"s{i}", [1], sampling, 64) for i, sampling in enumerate(asks)]
    reply = compute_pb2.ForwardResponse(token_ids=[10, 11, 12], logprobs=[-1, -2, -3], top_logprobs_width=2,
                                        top_token_ids=[10, 9, 12, 8],
                                        top_logprobs=[-1, -4, -3, -5])  # fmt: skip
    part = select_rows(reply, seqs, [False, True, True])
    assert (list(part.token_ids), list(part.logprobs)) == ([11, 12], [-2, -3])
    assert (list(part.top_token_ids), list(part.top_logprobs)) == ([12, 8], [-3, -5])
    assert part.top_logprobs_width == 2
    assert select_rows(reply, seqs, [True] * 3) is reply


# the compute side: the plan of a ForwardSteps call and the requests it derives
LIMITS = Limits(vocab_size=100, max_model_len=64, num_blocks=16, block_size=4)


def _steps_request(max_steps: list[int], stops: list[list[int]], tables=((0, 1), (2, 3))):
    first = forward_request([[5], [6]], [4, 2], [list(t) for t in tables], block_size=4)
    request = compute_pb2.StepsRequest(first=first, max_steps=max_steps, cu_stop_token_ids=[0])
    for ids in stops:
        request.stop_token_ids.extend(ids)
        request.cu_stop_token_ids.append(len(request.stop_token_ids))
    return request


def test_a_plan_stops_each_row_at_its_max_steps_or_a_stop_id():
    request = _steps_request([3, 2], [[9], []])
    plan = MultiStepPlan.check(request, LIMITS)
    assert plan.advance([7, 8]) == [0, 1] and plan.rows == [0, 1]
    assert plan.advance([9, 8]) == [] and plan.rows == []  # row 0 samples its stop id, row 1 ends its 2 steps


def test_a_plan_keeps_the_rows_that_go_on_in_order():
    first = forward_request([[5], [6], [7]], [4, 2, 3], [[0, 1], [2, 3], [4, 5]], block_size=4)
    first.block_tables[:] = [0, 1, 2, 3, 4, 5]
    request = compute_pb2.StepsRequest(
        first=first, max_steps=[3, 1, 3], stop_token_ids=[4], cu_stop_token_ids=[0, 0, 0, 1]
    )
    plan = MultiStepPlan.check(request, LIMITS)
    assert plan.advance([7, 8, 9]) == [0, 2] and plan.rows == [0, 2]  # row 1 ends its one step
    assert plan.advance([7, 4]) == [0] and plan.rows == [0]  # row 2 samples its stop id
    assert plan.advance([7]) == [] and plan.rows == []


@pytest.mark.parametrize(
    "max_steps, stops, tables, message",
    [
        ([3], [[], []], ((0, 1), (2, 3)), "one value per row"),
        ([0, 2], [[], []], ((0, 1), (2, 3)), r"each in \[1, 64\]"),
        ([65, 2], [[], []], ((0, 1), (2, 3)), r"each in \[1, 64\]"),
        ([2, 2], [[]], ((0, 1), (2, 3)), "cu_stop_token_ids"),
        ([5, 2], [[], []], ((0, 1), (2, 3)), "needs 3 blocks for 9 tokens"),  # row 0: 4 + 5 tokens
    ],
)
def test_a_plan_beyond_its_tables_or_with_bad_limits_is_refused(max_steps, stops, tables, message):
    with pytest.raises(InvalidArgument, match=message) as info:
        MultiStepPlan.check(_steps_request(max_steps, stops, tables), LIMITS)
    if "blocks" in message:
        assert isinstance(info.value, RowsRefused) and info.value.rows == (0,)


def test_a_plan_runs_decodes_only():
    request = _steps_request([2, 2], [[], []])
    request.first.CopyFrom(forward_request([[5, 6], [6]], [4, 2], [[0, 1, 4], [2, 3]], block_size=4))
    with pytest.raises(InvalidArgument, match="decodes only"):
        MultiStepPlan.check(request, LIMITS)


def _first_step() -> compute_pb2.ForwardRequest:
    """Three decodes: row 0 presence-penalized with a pending min_tokens, row 1 biased, row 2
    repetition-penalized, biased and seeded; every table reaches one more token."""
    first = forward_request([[5], [6], [7]], [4, 2, 3], [[0, 1], [2, 3], [4, 5]], block_size=4)
    first.block_tables[:] = [0, 1, 2, 3, 4, 5]
    first.sampling[0].presence_penalty = 0.5
    first.sampling[0].min_tokens = 4
    first.sampling[0].suppress_token_ids.extend([2, 3])
    first.sampling[1].logit_bias[11] = 2.0
    first.sampling[2].repetition_penalty = 1.2
    first.sampling[2].logit_bias[12] = -1.0
    first.sampling[2].seed = 9
    first.history_token_ids.extend([5, 1, 2, 6, 7])  # row 0: its generated tokens; row 1: none; row 2: 3
    first.cu_history.extend([0, 1, 1, 5])
    first.history_prompt_lens.extend([0, 0, 3])
    first.output_lens.extend([1, 0, 1])
    return first


@pytest.mark.parametrize(
    "keep, expected",
    [
        (
            [0, 2],  # row 1 is done
            dict(
                token_ids=[50, 70],
                num_computed=[5, 4],
                block_tables=[0, 1, 4, 5],
                history_token_ids=[5, 50, 1, 2, 6, 7, 70],
                cu_history=[0, 2, 7],
                history_prompt_lens=[0, 3],
                output_lens=[2, 2],
            ),
        ),
        (
            [0, 1, 2],
            dict(
                token_ids=[50, 60, 70],
                num_computed=[5, 3, 4],
                block_tables=[0, 1, 2, 3, 4, 5],
                history_token_ids=[5, 50, 1, 2, 6, 7, 70],  # row 1 is not penalized: no history
                cu_history=[0, 2, 2, 7],
                history_prompt_lens=[0, 0, 3],
                output_lens=[2, 1, 2],
            ),
        ),
    ],
)
def test_the_next_step_feeds_the_sampled_tokens_and_grows_the_penalties_history(keep, expected):
    """ForwardBatch.following gives the batch of the request the gateway would send for the next step."""
    first = _first_step()
    following = ForwardBatch.from_request(first, LIMITS).following(torch.tensor([50, 60, 70]), keep, 4)
    request = compute_pb2.ForwardRequest(
        cu_seqlens_q=range(len(keep) + 1),
        block_table_width=2,
        sample=[True] * len(keep),
        sampling=[first.sampling[i] for i in keep],
        **expected,
    )
    want = ForwardBatch.from_request(request, LIMITS)
    for got, wanted in [(following, want), (following.sampling, want.sampling)]:
        for field in fields(wanted):
            value, expected = getattr(got, field.name), getattr(wanted, field.name)
            if isinstance(expected, torch.Tensor):
                assert value.dtype == expected.dtype and torch.equal(value, expected), field.name
            elif field.name != "sampling":
                assert value == expected, field.name


class _Call:
    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()


def test_a_reply_deadline_cancels_the_call_only_when_a_step_overruns():
    call = _Call()
    deadline = ReplyDeadline(call, 0.2)
    for _ in range(4):  # replies every 0.1 s keep it alive past the first 0.2 s
        time.sleep(0.1)
        deadline.replied(0.2)
    assert not call.cancelled.is_set() and not deadline.expired
    assert call.cancelled.wait(2) and deadline.expired
    closed = ReplyDeadline(_Call(), 0.1)
    closed.close()
    time.sleep(0.2)
    assert not closed.expired
