"""One bad row never fails its neighbours: compute names the rows (sequences of the step) a refusal is caused
by, before anything is derived or written (the engine's side: tests/unit/test_recovery.py). Before, compute
refused the whole step naming no row, and every co-batched request failed with it."""

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from common.errors import BAD_ROWS_KEY, InvalidArgument, RowsRefused, refused_rows
from common.model_files import local_copy
from common.server import (
    MAX_DETAILS_BYTES,
    MAX_REQUEST_IDS_CHARS,
    REQUEST_ID_KEY,
    bounded_details,
    request_metadata,
)
from compute_service.batch import ForwardBatch
from compute_service.validation import Limits
from gateway.sampling import resolve_sampling
from gateway.sequence import Sampling, Sequence
from gateway.step_request import forward_request as gateway_request
from gateway.tokenizer import encode
from protos import common_pb2, compute_pb2, generation_pb2
from tests.fake_peers import RpcError
from tests.forward import forward_request
from tests.fuzz_strategies import Live, hints, messages, near_valid, valid_sampling

LIMITS = Limits(vocab_size=100, max_model_len=64, num_blocks=8, block_size=4)


def four_rows() -> compute_pb2.ForwardRequest:
    """Rows 0..3: a 3-token prefill (not sampled), then three decodes; sampling rows 0..2 are rows 1..3."""
    request = forward_request(
        [[1, 2, 3], [4], [5], [6]], [0, 4, 4, 4], [[0], [1, 2], [3, 4], [5, 6]], block_size=4,
        sample=[False, True, True, True],
    )  # fmt: skip
    ForwardBatch.from_request(request, LIMITS)
    return request


def refusal(request: compute_pb2.ForwardRequest) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as err:
        ForwardBatch.from_request(request, LIMITS)
    return err.value


def rows(request: compute_pb2.ForwardRequest) -> tuple[int, ...]:
    error = refusal(request)
    assert isinstance(error, RowsRefused), f"no row named: {error}"
    return error.rows


def test_each_check_of_a_row_names_every_row_that_fails_it():
    cases = {
        "token id": (lambda r: (r.token_ids.__setitem__(1, 100), r.token_ids.__setitem__(5, -1)), (0, 3)),
        "num_computed": (lambda r: r.num_computed.__setitem__(2, -1), (2,)),
        "beyond the model": (lambda r: r.num_computed.__setitem__(1, 64), (1,)),
        "table narrower": (lambda r: r.num_computed.__setitem__(3, 8), (3,)),
        "block outside": (lambda r: r.block_tables.__setitem__(5, 8), (2,)),
        "shared block written": (lambda r: r.block_tables.__setitem__(7, 2), (1, 3)),
    }
    for name, (mutate, expected) in cases.items():
        request = four_rows()
        mutate(request)
        assert rows(request) == expected, name


def test_a_sampling_row_is_named_as_its_sequence():
    request = four_rows()
    request.sampling[0].temperature = float("nan")
    request.sampling[2].temperature = float("inf")
    error = refusal(request)
    assert error.rows == (1, 3) and str(error).startswith("sampling[0].temperature = nan is invalid")
    request = four_rows()
    request.sampling[1].logit_bias[100] = 1.0
    assert rows(request) == (2,)
    request = four_rows()
    request.sampling[2].top_p = 0.0
    assert rows(request) == (3,)


def test_history_entries_are_named_as_their_rows():
    request = four_rows()
    request.history_token_ids.extend([1, 2, 300])
    request.cu_history.extend([0, 1, 1, 3])
    request.history_prompt_lens.extend([0, 0, 0])
    assert rows(request) == (3,)


def test_a_malformed_layout_names_no_row():
    for mutate in (
        lambda r: r.cu_seqlens_q.__setitem__(1, 5),
        lambda r: r.num_computed.append(0),
        lambda r: r.sampling.pop(),
        lambda r: r.output_lens.extend([1]),
    ):
        request = four_rows()
        mutate(request)
        assert not isinstance(refusal(request), RowsRefused)


def test_the_rows_travel_as_trailing_metadata_and_only_well_formed_ones_are_read():
    error = RowsRefused("bad", [5, 2, 5])
    assert error.trailing_metadata() == ((BAD_ROWS_KEY, "2,5"),)
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    assert refused_rows(RpcError(invalid, "bad", error.trailing_metadata())) == (2, 5)
    assert refused_rows(RpcError(grpc.StatusCode.INTERNAL, "x", error.trailing_metadata())) is None
    for value in ("", "1,,2", "-1", "²", "a"):
        assert refused_rows(RpcError(invalid, "x", ((BAD_ROWS_KEY, value),))) is None, value
    assert refused_rows(RpcError(invalid, "x")) is None


def test_the_gateway_checks_text_and_chat_prompts_against_the_models_vocabulary():
    """Before, only token_ids prompts were checked: a tokenizer knowing more tokens than the model (here a
    256-token model) sent rows compute refused, failing every request co-batched with them."""
    tokenizer = AutoTokenizer.from_pretrained(local_copy("smollm2").path)
    for request in (
        generation_pb2.GenerateRequest(prompt="The capital of France is"),
        generation_pb2.GenerateRequest(messages=[generation_pb2.ChatMessage(role="user", content="hi")]),
    ):
        with pytest.raises(InvalidArgument, match=r"outside the vocabulary \[0, 256\)"):
            encode(tokenizer, request, vocab_size=256)
        assert max(encode(tokenizer, request, vocab_size=len(tokenizer))) < len(tokenizer)


def test_forked_samples_wrap_their_seeds_at_two_to_the_64():
    """Found by the fuzz suite: seed 2**64 - 1 with n = 2 gave sample 1 the seed 2**64, which no RowSampling
    holds; building the step raised and every request co-batched with it failed with INTERNAL."""
    parent = Sequence(seq_id="p", prompt_ids=[1, 2], sampling=Sampling(seed=2**64 - 1, n=3), max_len=64)
    parent.num_computed = parent.chunk_end = 2
    seeds = [child.sampling.seed for child in parent.fork()]
    assert seeds == [0, 1]
    assert [compute_pb2.RowSampling(seed=seed).seed for seed in seeds] == seeds


def test_request_ids_travel_downstream_as_printable_ascii_of_bounded_length():
    """Found by the fuzz suite: a request_id of "\\x1f" made the gateway's Forward carry metadata gRPC refuses
    ("Invalid metadata"), so the step failed for every request in it."""
    ((key, value),) = request_metadata(["plain-id", "a\x1fb", "é😀", "x" * 10_000])
    assert key == REQUEST_ID_KEY and value.startswith("plain-id,a\\x1fb,\\xe9\\U0001f600,xxx")
    assert all(" " <= c <= "~" for c in value) and len(value) == MAX_REQUEST_IDS_CHARS


def test_error_messages_are_cut_to_fit_the_trailers():
    """Found by the fuzz suite: a refusal quoting a 100 KB session id exceeded gRPC's metadata limit, and the
    caller saw RESOURCE_EXHAUSTED ("received metadata size exceeds hard limit") instead of the status."""
    short = "unknown session 'abc'"
    assert bounded_details(short) == short
    cut = bounded_details("unknown session '" + "é" * 50_000 + "'")
    assert len(cut.encode()) <= MAX_DETAILS_BYTES + 40 and cut.endswith("more bytes)")
    assert cut.startswith("unknown session 'éé")


VOCAB_LIMITS = Limits(vocab_size=256, max_model_len=512, num_blocks=64, block_size=4)
HOSTILE = Live(64, 4, 256, 512, "epoch", {"s": 3}, "session", common_pb2.PoolHandle())


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    params=st.one_of(
        messages(generation_pb2.SamplingParams.DESCRIPTOR, hints(HOSTILE)),
        near_valid(valid_sampling(HOSTILE), HOSTILE),
    ),
    generated=st.integers(0, 8),
)
def test_every_request_the_gateway_accepts_makes_rows_compute_accepts(params, generated):
    """The gateway checks everything compute would refuse: any sampling the gateway accepts (hostile values
    from tests/fuzz_strategies.py) gives, for the request and each of its forked samples, at its first token
    and after `generated` more (min_tokens pending or not), a Forward compute accepts."""
    try:
        sampling = resolve_sampling(params, VOCAB_LIMITS.vocab_size)
    except InvalidArgument:
        return
    parent = Sequence(seq_id="p", prompt_ids=[1, 2, 3], sampling=sampling, max_len=64)
    parent.num_computed = parent.chunk_end = 3
    seqs = [parent, *(parent.fork() if sampling.n > 1 else [])]
    for seq in seqs:
        seq.output_ids = [5] * generated
        seq.num_computed, seq.chunk_end = (
            (0 if seq is parent and not generated else seq.num_tokens - 1),
            seq.num_tokens,
        )
    tables = [[3 * i, 3 * i + 1, 3 * i + 2] for i in range(len(seqs))]
    ForwardBatch.from_request(gateway_request(seqs, [tables], "epoch", frozenset({2})), VOCAB_LIMITS)
