"""Compute runs every torch call on one thread (compute_service/step_thread.py), whichever gRPC thread serves
the call: its OpenMP runtime then keeps one team of workers, not one per handler thread."""

import contextvars
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from cache_service.kv_pool import KVPool
from common.shared_pool import PoolSpec
from compute_service.model_loader import load
from compute_service.runner import Runner
from compute_service.server import ComputeServicer
from compute_service.step_thread import StepThread
from protos import compute_pb2
from tests.forward import forward_request
from tests.tiny_model import save_tiny_llama

BLOCK_SIZE = 16
REQUEST = contextvars.ContextVar("request", default=None)


def test_calls_run_in_order_on_one_thread_with_the_callers_context():
    steps = StepThread()
    REQUEST.set("r-1")
    seen = [steps.call(lambda: (threading.get_ident(), REQUEST.get())) for _ in range(3)]
    assert len({ident for ident, _ in seen}) == 1 and seen[0][0] != threading.get_ident()
    assert {request for _, request in seen} == {"r-1"}
    with pytest.raises(ZeroDivisionError):
        steps.call(lambda: 1 / 0)
    assert steps.call(len, "abc") == 3, "an exception does not stop the thread"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A servicer of a tiny Llama with a real pool attached, and the threads its model forwards ran on."""
    model, spec = load(str(save_tiny_llama(tmp_path_factory.mktemp("llama"))), torch.float32)
    steps = StepThread()
    log = SimpleNamespace(info=lambda *a, **k: None, debug=lambda *a, **k: None)
    servicer = ComputeServicer(Runner(model, spec.kv_scales, spec.plan), spec, log, steps=steps)
    pool_spec = PoolSpec(spec.num_layers, 16, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim, torch.float32)
    kv = KVPool.create(pool_spec, "tiny", "freelist", True)
    servicer.AttachPool(kv.handle, None)
    ran_on = []
    forward = model.model.forward

    def recorded(*args, **kwargs):
        ran_on.append(threading.get_ident())
        return forward(*args, **kwargs)

    model.model.forward = recorded
    yield servicer, kv.handle.epoch, ran_on, steps
    kv.release()


def test_forwards_from_many_threads_all_run_on_the_step_thread(served):
    servicer, epoch, ran_on, steps = served
    ran_on.clear()
    prompts = [[5 + i, 6, 7, 8, 9, 10 + i] for i in range(8)]

    def one(i: int) -> list[int]:
        request = forward_request([prompts[i]], [0], [[i * 2, i * 2 + 1]], block_size=BLOCK_SIZE, epoch=epoch)
        return list(servicer.Forward(request, None).token_ids)

    with ThreadPoolExecutor(8) as pool:
        tokens = list(pool.map(one, range(8)))
    assert all(len(t) == 1 for t in tokens)
    step_thread = steps.call(threading.get_ident)
    assert len(ran_on) == 8 and set(ran_on) == {step_thread}, "every step ran on the step thread"


def test_the_steps_of_a_forward_steps_call_run_on_the_step_thread(served):
    servicer, epoch, ran_on, steps = served
    ran_on.clear()
    prefill = forward_request([[11, 12, 13]], [0], [[0, 1]], block_size=BLOCK_SIZE, epoch=epoch)
    token = servicer.Forward(prefill, None).token_ids[0]
    first = forward_request([[token]], [3], [[0, 1]], block_size=BLOCK_SIZE, epoch=epoch)
    request = compute_pb2.StepsRequest(first=first, max_steps=[4], cu_stop_token_ids=[0, 0])
    done = threading.Event()

    def messages():  # the caller keeps its stream open until the call ends (half-closing would stop it)
        yield request
        done.wait(30)

    replies = list(servicer.ForwardSteps(messages(), None))
    done.set()
    assert len(replies) == 4 and all(len(reply.token_ids) == 1 for reply in replies)
    assert len(ran_on) == 5 and set(ran_on) == {steps.call(threading.get_ident)}
