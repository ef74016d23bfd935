"""A step fault fails only its cause (gateway/step_faults.py), over the fake peers: a gateway exception or a
compute INTERNAL in a co-batched step fails only the request whose row fails alone, the others end with
their tokens; a fault in the middle of a multi-step call loses nobody; the bisection's bound, and rows a
fault names failing without one. And a compute restart that keeps the KV: the running sequences go on from
their tables, no token computed twice. Faults come from the fake peers, or a test's StepHook
(tests/step_hooks.py)."""

import grpc
import pytest

from common.errors import PagedServeError, RowsRefused
from gateway import engine as engine_module
from gateway import step_faults, step_runner
from gateway.recovery import PeerFault
from gateway.sequence import Sequence
from gateway.step_faults import StepFaults, max_reruns
from tests.fake_engine import GREEDY, PROMPTS, assert_nothing_held, collect, run_all, start, submit, tokenizer
from tests.fake_peers import RpcError, unreachable

__all__ = ["start", "tokenizer"]  # fixtures
BAD_PROMPT = [40, 41, 1, 43]  # token 1 is never sampled (the fake samples from 3 up)


@pytest.fixture
def reference(start):
    engine, _, compute = start()
    outputs = run_all(engine)
    assert all(len(tokens) == GREEDY.max_tokens for tokens in outputs), outputs
    return outputs, compute.computed


def co_batched(engine, prompts: list[list[int]], bad: str = "") -> list:
    """The prompts submitted at once (so that they share steps), the last one with request id `bad`; their
    outputs."""
    with engine.inbox.lock:
        seqs = [
            submit(engine, p, request_id=bad if i == len(prompts) - 1 else "") for i, p in enumerate(prompts)
        ]
    return [collect(seq) for seq in seqs]


class Logs(list):
    """Stands in for a module's structlog logger: keeps each event as a dict (structlog's own capture misses
    loggers cached before it)."""

    def __getattr__(self, level: str):
        return lambda event, **fields: self.append({"event": event, **fields})


@pytest.fixture
def logs(monkeypatch) -> Logs:
    logs = Logs()
    monkeypatch.setattr(step_faults, "log", logs)
    monkeypatch.setattr(engine_module, "log", logs)
    monkeypatch.setattr(step_runner, "log", logs)
    return logs


def isolated(logs: list[dict]) -> list[dict]:
    return [e for e in logs if e["event"] == "step_fault_isolated"]


def test_an_exception_in_a_co_batched_step_fails_only_its_request(start, reference, logs):
    engine, cache, _ = start(step_hook="tests.step_hooks:FailStep=bad")
    *outputs, error = co_batched(engine, [*PROMPTS, BAD_PROMPT], bad="bad")
    assert isinstance(error, PagedServeError) and error.code == grpc.StatusCode.INTERNAL
    assert "RuntimeError" in str(error) and "request bad" in str(error)
    assert outputs == reference[0]
    faults = isolated(logs)
    assert faults and all(len(f["seq_ids"]) > 1 for f in faults), "the bad request shared its steps"
    assert {seq_id for f in faults for seq_id in f["failed"]} == {f"s{id(BAD_PROMPT)}-bad"}
    assert all(f["reruns"] <= max_reruns(len(f["seq_ids"])) for f in faults)
    assert_nothing_held(engine, cache)


@pytest.mark.parametrize("stage", ["schedule", "reserve", "update"])
def test_an_exception_in_any_stage_of_a_step_fails_only_its_request(stage, start, reference, logs):
    engine, cache, _ = start(step_hook=f"tests.step_hooks:FailStep={stage}:bad")
    *outputs, error = co_batched(engine, [*PROMPTS, BAD_PROMPT], bad="bad")
    assert isinstance(error, PagedServeError) and error.code == grpc.StatusCode.INTERNAL
    assert f"injected {stage} fault" in str(error) and "request bad" in str(error)
    assert outputs == reference[0]
    bad = f"s{id(BAD_PROMPT)}-bad"
    if stage == "reserve":  # a Reserve names no row: bisected
        faults = isolated(logs)
        assert faults and all(len(f["seq_ids"]) > 1 for f in faults), "the bad request shared its Reserves"
        assert {seq_id for f in faults for seq_id in f["failed"]} == {bad}
    else:  # the row's own code raised: it alone is set aside
        assert [e["seq_id"] for e in logs if e["event"] == "row_fault"] == [bad]
        assert not isolated(logs), "nothing was bisected"
    assert_nothing_held(engine, cache)


def test_a_reserve_the_cache_fails_naming_no_row_is_bisected_to_the_row_that_fails_alone(
    start, reference, logs
):
    engine, cache, _ = start()
    cache.broken = {1}
    *outputs, error = co_batched(engine, [*PROMPTS, BAD_PROMPT])
    assert isinstance(error, PagedServeError) and error.code == grpc.StatusCode.INTERNAL
    assert "a fault in the cache service" in str(error)
    assert outputs == reference[0]
    assert {seq_id for f in isolated(logs) for seq_id in f["failed"]} == {f"s{id(BAD_PROMPT)}-"}
    assert_nothing_held(engine, cache)


def test_an_update_fault_in_a_multi_step_call_fails_its_request_once_the_call_is_over(
    start, monkeypatch, reference, logs
):
    engine, cache, _ = start()
    bad = f"s{id(BAD_PROMPT)}-"
    append_token, free = step_runner.append_token, cache.Free
    faults, frees = [], []

    def fault_at_the_fourth_token(seq, token, eos, tokenizer):
        if seq.seq_id == bad and len(seq.output_ids) == 3:
            faults.append(engine.runner.executor.in_call)
            raise ValueError("no room for that token")
        return append_token(seq, token, eos, tokenizer)

    def recording_free(request, **kw):
        if bad in request.seq_ids:
            frees.append(engine.runner.executor.in_call)
        return free(request, **kw)

    monkeypatch.setattr(step_runner, "append_token", fault_at_the_fourth_token)
    monkeypatch.setattr(cache, "Free", recording_free)
    *outputs, error = co_batched(engine, [*PROMPTS, BAD_PROMPT])
    assert isinstance(error, PagedServeError) and "ValueError: no room for that token" in str(error)
    assert outputs == reference[0]
    assert faults == [True], "the fault came while compute ran the row in a multi-step call"
    assert frees == [False], "its blocks were freed once, after the call"
    assert [e["seq_id"] for e in logs if e["event"] == "row_fault"] == [bad]
    assert_nothing_held(engine, cache)


def test_a_compute_internal_naming_no_row_is_bisected_to_the_row_that_fails_alone(start, reference, logs):
    engine, cache, compute = start()
    compute.broken = {1}
    *outputs, error = co_batched(engine, [*PROMPTS, BAD_PROMPT])
    assert isinstance(error, PagedServeError) and error.code == grpc.StatusCode.INTERNAL
    assert "a fault in the model's code" in str(error)
    assert outputs == reference[0]
    assert [f["failed"] for f in isolated(logs)] == [[f"s{id(BAD_PROMPT)}-"]]
    assert_nothing_held(engine, cache)


def test_a_fault_in_the_middle_of_a_multi_step_call_reruns_its_step_and_loses_nobody(start, reference, logs):
    engine, cache, compute = start()

    def fault_once():
        calls.append(list(compute.call_steps))
        raise RpcError(grpc.StatusCode.INTERNAL, "a passing fault")

    calls = []

    # NOTE: two steps prefill the prompts; the 6th is the 4th step of a ForwardSteps call.
    compute.before[6] = fault_once
    assert run_all(engine) == reference[0]
    assert calls and calls[0][-1] > 1, "the fault came after the call's first step"
    assert [f["failed"] for f in isolated(logs)] == [[]], "the rerun succeeded: no request failed"
    assert_nothing_held(engine, cache)


class Live:
    """The engine's live sequences as StepFaults sees them: every row its own request; failing ends it."""

    def __init__(self, rows: list[Sequence]) -> None:
        self.rows, self.failed = rows, []

    def holds(self, seq: Sequence) -> bool:
        return seq not in self.failed

    def of_requests(self, group_ids: set[str]) -> list[Sequence]:
        return [seq for seq in self.rows if seq.group_id in group_ids and self.holds(seq)]

    def fail(self, seqs: list[Sequence], error: Exception) -> None:
        self.failed += seqs

    fail_internal = fail


def rows_of(n: int) -> list[Sequence]:
    return [Sequence(seq_id=f"r{i}", prompt_ids=[5], sampling=GREEDY, max_len=64) for i in range(n)]


def test_bisection_finds_one_faulty_row_within_its_bound_and_runs_every_other_row_once():
    rows, ran = rows_of(8), []
    live = Live(rows)

    def run(seqs):
        if rows[5] in seqs:
            raise RuntimeError("row 5")
        ran.extend(seqs)

    assert list(StepFaults(live).isolate(rows, RuntimeError("step"), run)) == []
    assert live.failed == [rows[5]] and sorted(ran, key=rows.index) == [r for r in rows if r is not rows[5]]
    assert max_reruns(8) == 6 and max_reruns(1) == max_reruns(2) == 2

    live, calls = Live(rows), []

    def every_row_fails(seqs):
        calls.append(seqs)
        raise RuntimeError("every row")

    assert list(StepFaults(live).isolate(rows, RuntimeError("step"), every_row_fails)) == []
    assert len(calls) == max_reruns(8) and sorted(live.failed, key=rows.index) == rows, "bounded, then failed"


def refusal(rows: list[int]) -> PeerFault:
    error = RowsRefused("token_ids hold a bad token", rows)
    return PeerFault(
        "compute", RpcError(grpc.StatusCode.INVALID_ARGUMENT, str(error), error.trailing_metadata())
    )


def test_rows_a_fault_names_fail_alone_and_the_rest_run_again_without_a_bisection():
    rows = rows_of(6)
    live, calls = Live(rows), []

    def run(seqs):
        calls.append(seqs)
        if rows[4] in seqs:  # named at its place in this call's rows
            raise refusal([seqs.index(rows[4])])
        return seqs

    assert list(StepFaults(live).isolate(rows, refusal([1, 3]), run)) == [[rows[0], rows[2], rows[5]]]
    assert live.failed == [rows[1], rows[3], rows[4]]
    assert calls == [[rows[0], rows[2], rows[4], rows[5]], [rows[0], rows[2], rows[5]]], "no halves"


def test_a_refusal_naming_a_row_outside_the_call_names_none_and_is_bisected():
    rows, ran = rows_of(2), []
    live = Live(rows)
    assert step_faults.named(rows, refusal([3])) == [] and step_faults.named(rows, refusal([1])) == [rows[1]]
    assert list(StepFaults(live).isolate(rows, refusal([3]), lambda seqs: ran.append(seqs))) == []
    assert ran == [[rows[0]], [rows[1]]] and live.failed == []


def test_a_compute_restart_keeps_the_tables_and_computes_no_token_twice(start, reference, logs):
    engine, cache, compute = start()
    epoch = cache.epoch

    def die_and_restart():
        compute.restart()
        raise unreachable("compute")

    # NOTE: the 8th step is a decode, with tokens of every prompt computed and blocks partly filled
    compute.before[8] = die_and_restart
    assert run_all(engine) == reference[0]
    assert not compute.before, "the fault happened"
    assert compute.computed == reference[1], "each token computed once: only the lost step ran again"
    attached = [e for e in logs if e["event"] == "attached"]
    assert attached[-1]["kept_running"] == len(PROMPTS), "the tables were kept"
    assert compute.epoch == epoch == cache.epoch, "the cache kept its pool: the same one is attached again"
    assert_nothing_held(engine, cache)
