"""The compute service as a real process: model info, pool attachment, paged generation, refusals; and
ForwardSteps: several decode steps per call give the tokens of one Forward per step (greedy, seeded
sampling, penalties), rows stop at their limits or stop ids, the caller's half-close ends the call after the
running step, and a bad call is refused before touching the pool; with prompt-lookup drafts, the same greedy
tokens in fewer steps whatever the drafts, and none drafted for sampled rows."""

import importlib.util
import json
import threading
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from common import shared_pool
from common.server import channel
from compute_service.lean_imports import HIDDEN
from compute_service.plan import STAGES
from compute_service.server import SEGMENT_CHECK_S
from compute_service.stepper import SEGMENT_REMOVED
from protos import common_pb2, compute_pb2, compute_pb2_grpc
from tests.forward import forward_request as paged_forward_request
from tests.forward import replace_field as _replace
from tests.forward import set_field as _set
from tests.helpers import free_port, start, stop, wait_healthy
from tests.tiny_model import save_tiny_llama

pytestmark = pytest.mark.e2e

BLOCK_SIZE, NUM_BLOCKS, LAYERS, KV_HEADS, HEAD_DIM, VOCAB = 4, 32, 2, 2, 16, 256
PROMPTS = [[5, 6, 7, 8, 9], [100, 3, 44, 55, 66, 77, 88, 99, 11, 12, 13], [10, 20, 30]]


forward_request = partial(paged_forward_request, block_size=BLOCK_SIZE)


def small_step(epoch: str) -> compute_pb2.ForwardRequest:
    """Two sequences: 6 new tokens on 2 cached ones, and a fresh 3-token prompt."""
    return forward_request([[1, 2, 3, 4, 5, 6], [7, 8, 9]], [2, 0], [[20, 21], [22]], epoch=epoch)


def refusal(call, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=30)
    return info.value


def make_pool(**overrides) -> tuple[torch.Tensor, common_pb2.PoolHandle]:
    geometry = dict(
        num_layers=LAYERS,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=torch.float32,
    )
    return shared_pool.create(shared_pool.PoolSpec(**{**geometry, **overrides}))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama", initializer_range=0.3)


@pytest.fixture(scope="module")
def service(model_dir, tmp_path_factory):
    port = free_port()
    args = [
        "--model",
        str(model_dir),
        "--dtype",
        "float32",
        "--port",
        str(port),
        "--threads",
        "2",
        "--insecure",
        "--log-format",
        "json",
    ]
    log_path = tmp_path_factory.mktemp("logs") / "compute.log"
    proc = start("compute_service", *args, log_path=log_path)
    target = f"127.0.0.1:{port}"
    try:
        wait_healthy(target, proc, timeout=120)
        with channel(target) as ch:
            stub = compute_pb2_grpc.ComputeStub(ch)
            # before any AttachPool, so it does not depend on test order
            no_pool = refusal(stub.Forward, small_step(""))
            yield SimpleNamespace(stub=stub, no_pool=no_pool, pid=proc.pid, log_path=log_path)
    finally:
        assert stop(proc) == 0


@pytest.fixture(scope="module")
def pool(service):
    tensor, handle = make_pool()
    try:
        reply = service.stub.AttachPool(handle, timeout=30)
        yield SimpleNamespace(tensor=tensor, handle=handle, epoch=handle.epoch, reply=reply)
    finally:
        shared_pool.release(handle)


def test_the_service_maps_no_library_of_the_packages_hidden_from_transformers(service):
    """`python -m compute_service` loads transformers' modeling code with scipy hidden from it
    (compute_service/lean_imports.py): scipy is installed, and the running service, its model loaded, maps
    none of its compiled modules."""
    maps = Path(f"/proc/{service.pid}/maps").read_text()
    assert "libtorch" in maps
    for name in HIDDEN:
        spec = importlib.util.find_spec(name)
        assert spec is not None, f"{name} is not installed: nothing to check"
        directory = spec.submodule_search_locations[0]
        assert directory not in maps, f"compute maps {name}'s libraries: something imports it at start again"


def test_model_info(service, model_dir):
    info = service.stub.GetModelInfo(compute_pb2.GetModelInfoRequest(), timeout=30)
    assert info.model == model_dir.name
    assert (info.num_layers, info.num_attention_heads, info.num_kv_heads, info.head_dim) == (LAYERS, 4, 2, 16)
    assert (info.dtype, info.vocab_size, info.max_model_len) == ("float32", VOCAB, 512)
    assert list(info.eos_token_ids) == [2]
    assert info.attention_backend == "cpu-native", "float32 on a machine that builds the native kernels"
    plan = info.execution_plan
    assert (plan.architecture, plan.device, plan.native_kernels) == ("llama", "cpu", True)
    stages = {stage.stage: stage for stage in plan.stages}
    assert list(stages) == list(STAGES) and all(stage.reason for stage in plan.stages)
    assert stages["layers"].implementation == "fused"
    assert stages["layers.decode"].implementation == "native-stack"
    assert stages["linears.decoder"].implementation == "panels float32"
    assert stages["attention.decode"].implementation.startswith("cpu-native: ")
    assert stages["sampling.greedy"].implementation == "native"


def test_the_plan_is_logged_at_start_up_as_one_line(service):
    lines = [line for line in service.log_path.read_text().splitlines() if "execution_plan" in line]
    assert len(lines) == 1
    logged = json.loads(lines[0])
    assert logged["event"] == "execution_plan" and logged["attention_backend"] == "cpu-native"
    assert [logged[stage] for stage in ("layers", "layers.decode")] == ["fused", "native-stack"]


def test_forward_before_attach_is_refused(service):
    assert service.no_pool.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "AttachPool" in service.no_pool.details()


def test_attach_reports_the_pool(pool):
    assert pool.reply.epoch == pool.epoch
    assert pool.reply.num_blocks == NUM_BLOCKS


def test_paged_generation_matches_hugging_face_greedy(service, pool, model_dir):
    blocks = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(1)).tolist()
    tables = [blocks[0:6], blocks[6:12], blocks[12:18]]
    generated = [[] for _ in PROMPTS]
    new, cached = PROMPTS, [0] * len(PROMPTS)
    for _ in range(7):
        reply = service.stub.Forward(forward_request(new, cached, tables, epoch=pool.epoch), timeout=60)
        assert len(reply.token_ids) == len(reply.logprobs) == len(PROMPTS)
        assert all(lp <= 0 for lp in reply.logprobs) and reply.forward_ms > 0
        for seq, token in enumerate(reply.token_ids):
            generated[seq].append(token)
        cached = [c + len(n) for c, n in zip(cached, new, strict=True)]
        new = [[token] for token in reply.token_ids]

    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for seq, prompt in enumerate(PROMPTS):
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=7, do_sample=False)[
            0, len(prompt) :
        ]
        assert generated[seq][: len(expected)] == expected.tolist()


def _narrow_tables(request: compute_pb2.ForwardRequest) -> None:
    # one column per sequence, too few for sequence 0's 8 tokens
    _replace("block_tables", [20, 22])(request)
    request.block_table_width = 1


def _sampling(**params):
    def mutate(request: compute_pb2.ForwardRequest) -> None:
        request.sampling[1].CopyFrom(compute_pb2.RowSampling(**params))

    return mutate


BAD_REQUESTS = {
    "block outside the pool": (_set("block_tables", 0, NUM_BLOCKS + 3), "outside the pool"),
    "block missing from the table": (_set("block_tables", 1, -1), "block_tables[0][1] = -1"),
    "shared block written": (_set("block_tables", 2, 21), "written by two new tokens"),
    "token outside vocab": (_set("token_ids", 7, VOCAB), "token_ids[7]"),
    "cu_seqlens not increasing": (_replace("cu_seqlens_q", [0, 6, 6, 9]), "cu_seqlens_q"),
    "cu_seqlens not ending at num tokens": (_replace("cu_seqlens_q", [0, 6, 8]), "cu_seqlens_q"),
    "num_computed count": (_replace("num_computed", [2]), "num_computed has 1 entries"),
    "num_computed negative": (_set("num_computed", 0, -1), "num_computed[0]"),
    "context beyond the model": (_set("num_computed", 1, 510), "maximum length 512"),
    "too few table entries": (_replace("block_tables", [20, 22]), "block_tables"),
    "table narrower than the context": (_narrow_tables, "block_table_width is 1"),
    "sampling count": (_replace("sample", [True, False]), "sampling entries"),
    "negative temperature": (_sampling(temperature=-1.0), "temperature"),
    "top_p zero": (_sampling(top_p=0.0), "top_p"),
}


@pytest.mark.parametrize("mutate, message", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_bad_step_is_refused_before_touching_the_pool(service, pool, mutate, message):
    request = small_step(pool.epoch)
    mutate(request)
    before = pool.tensor.clone()
    error = refusal(service.stub.Forward, request)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.details()
    assert torch.equal(pool.tensor, before)


def test_valid_step_writes_exactly_its_slots(service, pool):
    pool.tensor.zero_()
    service.stub.Forward(small_step(pool.epoch), timeout=30)
    written = (pool.tensor != 0).flatten(4).any(-1).any(0).any(0).flatten()  # per slot
    # block_table[p // block_size] * block_size + p % block_size of each new token's position p
    spans = (([20, 21], range(2, 8)), ([22], range(3)))
    slots = [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for table, span in spans for p in span]
    assert written.nonzero().squeeze(1).tolist() == slots


def test_stale_epoch_is_refused(service, pool):
    error = refusal(service.stub.Forward, small_step("0" * 32))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "stale pool epoch" in error.details()


@pytest.mark.parametrize(
    "geometry", [dict(head_dim=8), dict(num_kv_heads=1), dict(num_layers=3), dict(dtype=torch.bfloat16)]
)
def test_attach_with_wrong_geometry_is_refused(service, pool, geometry):
    _, handle = make_pool(**geometry)
    try:
        error = refusal(service.stub.AttachPool, handle)
    finally:
        shared_pool.release(handle)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "expected shape" in error.details()
    service.stub.Forward(small_step(pool.epoch), timeout=30)


def test_reattach_replaces_the_pool(service, pool):
    tensor, handle = make_pool()
    try:
        assert service.stub.AttachPool(handle, timeout=30).epoch == handle.epoch
        service.stub.Forward(small_step(handle.epoch), timeout=30)
        assert tensor.abs().sum() > 0
        error = refusal(service.stub.Forward, small_step(pool.epoch))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    finally:
        service.stub.AttachPool(pool.handle, timeout=30)
        shared_pool.release(handle)


def _mapped(pid: int, path: str) -> bool:
    return path in Path(f"/proc/{pid}/maps").read_text()


def test_a_removed_segment_is_unmapped_and_refused(service, pool):
    _, handle = make_pool()
    try:
        service.stub.AttachPool(handle, timeout=30)
        service.stub.Forward(small_step(handle.epoch), timeout=30)
        assert _mapped(service.pid, handle.shm.path)
        shared_pool.release(handle)  # as a cache's exit does; no Forward comes meanwhile
        deadline = time.monotonic() + 3 * SEGMENT_CHECK_S + 2
        while _mapped(service.pid, handle.shm.path) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _mapped(service.pid, handle.shm.path), "compute unmapped the removed segment"
        error = refusal(service.stub.Forward, small_step(handle.epoch))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert error.details() == SEGMENT_REMOVED
    finally:
        shared_pool.release(handle)
        service.stub.AttachPool(pool.handle, timeout=30)


# ForwardSteps
STEPS = 6
HALF_CLOSED_STEPS = 20


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


def decode_request(
    epoch: str, tokens: list[int], generated: int, steps: int = STEPS
) -> compute_pb2.ForwardRequest:
    """The decode step feeding `tokens` after `generated` tokens of each prompt; tables hold `steps` more."""
    cached = [len(p) + generated - 1 for p in PROMPTS]
    request = forward_request([[t] for t in tokens], cached, tables(), epoch=epoch)
    width = max(-(-(c + steps) // BLOCK_SIZE) for c in cached)
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
    """Calls ForwardSteps; half-closes after `stop_after` replies (0: right after the request, None: once the
    call ends). Returns the replies."""
    stop = threading.Event()
    if stop_after == 0:
        stop.set()

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
    head = decode_request(epoch, first, 1, max(max_steps))
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
    """Per row, the tokens of a call that ran to its end; each reply says a row runs on after it but for the
    row's last."""
    out, running = [[] for _ in PROMPTS], [[] for _ in PROMPTS]
    for reply in replies:
        # a step's later replies (its rows' kept drafts) carry no times
        assert len(reply.rows) == len(reply.token_ids) and (reply.forward_ms > 0) != reply.same_step
        for row, token, going in zip(reply.rows, reply.token_ids, reply.running, strict=True):
            out[row].append(token)
            running[row].append(going)
    assert running == [[True] * (len(flags) - 1) + [False] for flags in running]
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


def test_the_callers_half_close_ends_the_call_before_its_steps_run_out(service, pool):
    first = prefill(service, pool.epoch)
    # NOTE: half-closed at once, with room for 20 steps (the tables' 32 slots past the longest prompt). A step
    # of the tiny model takes about a millisecond; compute hears of the half-close on another thread, which
    # waits for gRPC's poller and the GIL, a few steps' time on a loaded machine
    replies = in_steps(service, steps_request(pool.epoch, first, [HALF_CLOSED_STEPS] * 3), stop_after=0)
    assert 1 <= len(replies) < HALF_CLOSED_STEPS, "the half-close ended the call before max_steps"


def _narrow(request: compute_pb2.StepsRequest) -> None:
    width = request.first.block_table_width
    for i in range(len(request.first.num_computed)):
        # row i keeps only the blocks of its first step
        need = -(-(request.first.num_computed[i] + 1) // BLOCK_SIZE)
        for col in range(need, width):
            request.first.block_tables[i * width + col] = -1


def with_lookup(request: compute_pb2.StepsRequest, lookups: list[list[int]], draft_tokens: int = 4):
    request.draft_tokens = draft_tokens
    request.cu_lookup_token_ids.append(0)
    for ids in lookups:
        request.lookup_token_ids.extend(ids)
        request.cu_lookup_token_ids.append(len(request.lookup_token_ids))
    return request


# NOTE: a run the tiny model's tokens do not make (vocabulary 256): the lookup finds the row's token only
# after it, so a row drafts what the lookup holds after that.
MARK = [253, 254]


def lookups(first: list[int], continuations: list[list[int]]) -> list[list[int]]:
    """Each row's lookup tokens: MARK, its token, the continuation, then MARK and its token (fed now)."""
    return [[*MARK, f, *c, *MARK, f] for f, c in zip(first, continuations, strict=True)]


def _drafts(replies) -> tuple[int, int, int]:
    """The steps compute ran, the drafts they fed and how many of them the rows kept."""
    steps = [r for r in replies if not r.same_step]
    return len(steps), sum(r.drafted_tokens for r in steps), sum(r.accepted_tokens for r in steps)


def test_drafts_of_the_greedy_tokens_are_kept_several_a_step(service, pool):
    first = prefill(service, pool.epoch)
    expected = one_by_one(service, pool.epoch, first)
    request = with_lookup(steps_request(pool.epoch, first, [STEPS] * 3), lookups(first, expected))
    replies = in_steps(service, request)
    assert per_row(replies) == expected
    # step 1 feeds each row's token and 4 drafts and keeps all 5 tokens; step 2 has room for one token only
    assert _drafts(replies) == (2, 12, 12)
    assert [list(r.rows) for r in replies] == [[0, 1, 2]] * STEPS


def test_drafts_the_model_disagrees_with_change_no_token(service, pool):
    first = prefill(service, pool.epoch)
    expected = one_by_one(service, pool.epoch, first)
    wrong = [[(t + 1) % 250 for t in row] for row in expected]
    replies = in_steps(
        service, with_lookup(steps_request(pool.epoch, first, [STEPS] * 3), lookups(first, wrong))
    )
    assert per_row(replies) == expected
    assert replies[0].drafted_tokens == 12 and replies[0].accepted_tokens == 0


def test_a_stop_id_among_kept_drafts_ends_its_row_there(service, pool):
    first = prefill(service, pool.epoch)
    expected = one_by_one(service, pool.epoch, first)
    stop_id = expected[2][1]
    request = steps_request(pool.epoch, first, [STEPS, 3, STEPS], [[], [], [stop_id]])
    got = per_row(in_steps(service, with_lookup(request, lookups(first, expected))))
    assert got[0] == expected[0] and got[1] == expected[1][:3]
    assert got[2] == expected[2][: expected[2].index(stop_id) + 1]


def test_sampled_rows_draft_nothing(service, pool):
    sampling = SAMPLINGS["seeded"]
    first = prefill(service, pool.epoch, sampling)
    expected = one_by_one(service, pool.epoch, first, sampling)
    request = steps_request(pool.epoch, first, [STEPS] * 3, sampling=sampling)
    replies = in_steps(service, with_lookup(request, lookups(first, expected)))
    assert per_row(replies) == expected and _drafts(replies) == (STEPS, 0, 0)


BAD_CALLS = {
    "tables too short for max_steps": (_narrow, "blocks for"),
    "a prompt chunk": (lambda r: r.first.cu_seqlens_q.__setitem__(1, 0), "cu_seqlens_q"),
    "max_steps zero": (lambda r: r.max_steps.__setitem__(0, 0), "max_steps"),
    "max_steps count": (lambda r: r.max_steps.append(1), "max_steps"),
    "stop offsets": (lambda r: r.cu_stop_token_ids.append(9), "cu_stop_token_ids"),
    "too many drafts": (lambda r: with_lookup(r, [[1]] * 3, draft_tokens=17), "draft_tokens"),
    "drafts without lookup": (lambda r: setattr(r, "draft_tokens", 4), "cu_lookup_token_ids"),
    "lookup offsets": (lambda r: with_lookup(r, [[1], [2]]), "cu_lookup_token_ids"),
    "lookup id past the vocabulary": (lambda r: with_lookup(r, [[1], [VOCAB], [2]]), "lookup_token_ids"),
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
