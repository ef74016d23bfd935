"""The gateway's admission gate: requests admitted until the drain, running ones finish or are cut."""

import threading
import time

import pytest

from common.errors import Unavailable
from gateway.admission import CUT, DRAINING, Admission
from gateway.sampling import resolve_sampling
from gateway.sequence import Sequence
from protos import generation_pb2


def seq(seq_id: str) -> Sequence:
    sampling = resolve_sampling(generation_pb2.SamplingParams(max_tokens=4), 50)
    return Sequence(seq_id=seq_id, prompt_ids=[1, 2], sampling=sampling, max_len=64)


def test_a_drain_refuses_new_requests_and_waits_for_the_running_ones():
    admission = Admission()
    running = [seq("a"), seq("b")]
    for s in running:
        admission.enter(s)
    drained = []
    drainer = threading.Thread(target=lambda: drained.append(admission.drain(timeout=30)))
    drainer.start()
    while not admission.draining:
        time.sleep(0.01)
    with pytest.raises(Unavailable, match=DRAINING):
        admission.enter(seq("c"))
    admission.leave("a")
    assert drainer.is_alive(), "b still runs"
    admission.leave("b")
    drainer.join(5)
    assert drained == [0], "nothing was cut"
    assert all(s.outbox.empty() for s in running)


def test_requests_still_running_at_the_timeout_are_cut_with_unavailable():
    admission = Admission()
    finished, slow = seq("finished"), seq("slow")
    admission.enter(finished)
    admission.enter(slow)
    admission.leave("finished")
    started = time.monotonic()
    assert admission.drain(timeout=0.2) == 1
    assert time.monotonic() - started >= 0.2
    cut = slow.outbox.get_nowait()
    assert isinstance(cut, Unavailable) and str(cut) == CUT
    assert finished.outbox.empty()
    assert admission.running() == 1, "a cut request leaves when its stream ends"


def test_an_idle_gateway_drains_at_once():
    admission = Admission()
    started = time.monotonic()
    assert admission.drain(timeout=30) == 0
    assert time.monotonic() - started < 1
