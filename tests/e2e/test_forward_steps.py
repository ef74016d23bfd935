"""Compute.ForwardSteps on the real compute process: several decode steps per call give the tokens of one
Forward per step (greedy, seeded sampling, penalties), rows stop at their limits or stop ids, the caller's
half-close ends the call after the running step, and a bad call is refused before touching the pool."""

import threading

import grpc
import pytest
import torch

from protos import compute_pb2
from tests.e2e.test_compute_service import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    PROMPTS,
    forward_request,
    make_pool,
    model_dir,
    pool,
    service,
)

pytestmark = pytest.mark.e2e
__all__ = ["model_dir", "pool", "service", "make_pool"]  # fixtures and helpers of the compute module
STEPS = 6


def tables() -> list[list[int]]:
    blocks = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(3)).tolist()
    return [blocks[0:8], blocks[8:16], blocks[16:24]]


def prefill(service, epoch: str, sampling: compute_pb2.RowSampling | None = None) -> list[int]:
    """The prompts' first step; returns each row's first token."""
    request = forward_request(PROMPTS, [0] * len(PROMPTS), tables(), epoch=epoch)
    if sampling is not None:
        for row in request.sampling:
            row.CopyFrom(sampling)
    return list(service.stub.Forward(request, timeout=60).token_ids)


def decode_request(epoch: str, tokens: list[int], generated: int) -> compute_pb2.ForwardRequest:
    """The decode step feeding `tokens` after `generated` tokens of each prompt, tables holding STEPS more."""
    cached = [len(p) + generated - 1 for p in PROMPTS]
    request = forward_request([[t] for t in tokens], cached, tables(), epoch=epoch)
    width = max(-(-(c + STEPS) // BLOCK_SIZE) for c in cached)
    del request.block_tables[:]
    request.block_tables.extend(b for table in tables() for b in table[:width] + [-1] * (width - len(table)))
    request.block_table_width = width
    return request


def one_by_one(service, epoch: str, first: list[int], sampling=None) -> list[list[int]]:
    """STEPS decode steps as one Forward each; per row the tokens sampled."""
    out, tokens = [[] for _ in PROMPTS], first
    for step in range(STEPS):
        request = decode_request(epoch, tokens, step + 1)
        if sampling is not None:
            for row in request.sampling:
                row.CopyFrom(sampling)
            # a penalty's history: each row's generated tokens so far, the one it feeds now included
            _history(request, [[f, *row] for f, row in zip(first, out, strict=True)], sampling)
        tokens = list(service.stub.Forward(request, timeout=60).token_ids)
        for row, token in zip(out, tokens, strict=True):
            row.append(token)
    return out


def _history(request: compute_pb2.ForwardRequest, histories: list[list[int]], sampling) -> None:
    if not sampling.presence_penalty:
        return
    request.history_token_ids.extend(t for h in histories for t in h)
    request.cu_history.append(0)
    for h in histories:
        request.cu_history.append(request.cu_history[-1] + len(h))
    request.history_prompt_lens.extend([0] * len(histories))


def in_steps(service, request: compute_pb2.StepsRequest, stop_after: int | None = None):
    """Calls ForwardSteps; half-closes after `stop_after` replies (None: once the call ends). Returns the
    replies."""
    stop = threading.Event()

    def messages():
        yield request
        stop.wait(60)

    replies = []
    for reply in service.stub.ForwardSteps(messages(), timeout=120):
        replies.append(reply)
        if stop_after is not None and len(replies) == stop_after:
            stop.set()
    stop.set()
    return replies


def steps_request(epoch, first, max_steps, stops=None, sampling=None) -> compute_pb2.StepsRequest:
    head = decode_request(epoch, first, 1)
    if sampling is not None:
        for row in head.sampling:
            row.CopyFrom(sampling)
        _history(head, [[f] for f in first], sampling)
    request = compute_pb2.StepsRequest(first=head, max_steps=max_steps, cu_stop_token_ids=[0])
    for ids in stops or [[]] * len(first):
        request.stop_token_ids.extend(ids)
        request.cu_stop_token_ids.append(len(request.stop_token_ids))
    return request


def per_row(replies) -> list[list[int]]:
    out = [[] for _ in PROMPTS]
    for reply in replies:
        assert len(reply.rows) == len(reply.token_ids) and reply.forward_ms > 0
        for row, token in zip(reply.rows, reply.token_ids, strict=True):
            out[row].append(token)
    return out


SAMPLINGS = {
    "greedy": None,
    "seeded": compute_pb2.RowSampling(temperature=1.0, top_p=0.9, seed=11),
    # the bias makes token 42 the greedy choice; the penalties take it away once it has been sampled
    "penalties": compute_pb2.RowSampling(
        temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0, logit_bias={42: 4.0}
    ),
}


@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
def test_steps_in_one_call_sample_what_one_forward_per_step_does(service, pool, sampling):
    first = prefill(service, pool.epoch, sampling)
    expected = one_by_one(service, pool.epoch, first, sampling)
    replies = in_steps(service, steps_request(pool.epoch, first, [STEPS] * 3, sampling=sampling))
    if sampling is SAMPLINGS["penalties"]:
        unpenalized = compute_pb2.RowSampling(temperature=0.0, logit_bias=sampling.logit_bias)
        assert expected != one_by_one(service, pool.epoch, first, unpenalized), "no penalty took effect"
    assert len(replies) == STEPS and all(list(r.rows) == [0, 1, 2] for r in replies)
    assert per_row(replies) == expected


def test_rows_stop_at_their_max_steps_or_stop_ids(service, pool):
    first = prefill(service, pool.epoch)
    expected = one_by_one(service, pool.epoch, first)
    stop_id = expected[2][1]  # row 2 stops after its second step, on this id
    replies = in_steps(service, steps_request(pool.epoch, first, [STEPS, 3, STEPS], [[], [], [stop_id]]))
    got = per_row(replies)
    assert got[0] == expected[0] and got[1] == expected[1][:3]
    assert got[2] == expected[2][: expected[2].index(stop_id) + 1]
    assert [list(r.rows) for r in replies][:3] == [[0, 1, 2], [0, 1, 2], [0, 1]]


def test_the_callers_half_close_ends_the_call_after_the_running_step(service, pool):
    first = prefill(service, pool.epoch)
    replies = in_steps(service, steps_request(pool.epoch, first, [STEPS] * 3), stop_after=1)
    # compute may have begun the second step when the half-close came; it never runs a third
    assert 1 <= len(replies) <= 2


def _narrow(request: compute_pb2.StepsRequest) -> None:
    width = request.first.block_table_width
    for i in range(len(request.first.num_computed)):
        # row i keeps only the blocks of its first step
        need = -(-(request.first.num_computed[i] + 1) // BLOCK_SIZE)
        for col in range(need, width):
            request.first.block_tables[i * width + col] = -1


BAD_CALLS = {
    "tables too short for max_steps": (_narrow, "blocks for"),
    "a prompt chunk": (lambda r: r.first.cu_seqlens_q.__setitem__(1, 0), "cu_seqlens_q"),
    "max_steps zero": (lambda r: r.max_steps.__setitem__(0, 0), "max_steps"),
    "max_steps count": (lambda r: r.max_steps.append(1), "max_steps"),
    "stop offsets": (lambda r: r.cu_stop_token_ids.append(9), "cu_stop_token_ids"),
}


@pytest.mark.parametrize("mutate, message", BAD_CALLS.values(), ids=BAD_CALLS.keys())
def test_a_bad_call_is_refused_before_touching_the_pool(service, pool, mutate, message):
    request = steps_request(pool.epoch, [5, 6, 7], [STEPS] * 3)
    mutate(request)
    before = pool.tensor.clone()
    with pytest.raises(grpc.RpcError) as info:
        in_steps(service, request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()
    assert torch.equal(pool.tensor, before)


def test_a_call_without_a_message_is_refused(service):
    with pytest.raises(grpc.RpcError) as info:
        list(service.stub.ForwardSteps(iter([]), timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "first message" in info.value.details()
