"""A request's block-sparse decode from each client to compute's rows: the SDK's, the HTTP body's and the
CLI's forms of GenerateRequest.sparse_attention; the gateway's settings for it against what compute enables
(ModelInfo.sparse_attention), and its refusals saying how to enable it; the rows the gateway sends
(ForwardRequest.sparse) and compute's checks of them, kept across a multi-step decode."""

import argparse

import pytest
import torch

from cli.generate import _sparse as cli_sparse
from common.errors import InvalidArgument, RowsRefused
from common.sparse_settings import SparseAttention, SparseMode
from compute_service.batch import ForwardBatch
from compute_service.model_info import sparse_support
from compute_service.validation import Limits
from gateway.http.openai_request import CompletionRequest, completion_request, parse
from gateway.sparse_request import DENSE, resolve
from gateway.step_request import forward_request as gateway_request
from protos import compute_pb2, generation_pb2
from sdk.request import build_request
from tests.forward import forward_request, gateway_seq

ALLOW, ON = SparseMode(SparseAttention(1, 2, 3), default=False), SparseMode(SparseAttention(1, 2, 3))
LIMITS = Limits(vocab_size=100, max_model_len=256, num_blocks=64, block_size=4, sparse=ALLOW)


def info(mode: SparseMode | None, backend: str = "cpu-native") -> compute_pb2.ModelInfo:
    return compute_pb2.ModelInfo(attention_backend=backend, sparse_attention=sparse_support(mode))


def asking(**fields) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        prompt="hi", sparse_attention=generation_pb2.SparseAttention(**fields)
    )


@pytest.mark.parametrize(
    ("request_", "mode", "row"),
    [
        (generation_pb2.GenerateRequest(prompt="hi"), None, None),
        (generation_pb2.GenerateRequest(prompt="hi"), ALLOW, DENSE),
        (generation_pb2.GenerateRequest(prompt="hi"), ON, (1, 2, 3)),
        (asking(enabled=False), None, None),
        (asking(enabled=False), ON, DENSE),
        (asking(enabled=True), ALLOW, (1, 2, 3)),
        (asking(enabled=True, topk=16, sink=0), ALLOW, (0, 2, 16)),
    ],
    ids=["off", "allow", "on", "dense off", "dense on", "asked", "own settings"],
)
def test_the_gateway_gives_each_request_its_rows(request_, mode, row):
    assert resolve(request_, info(mode)) == row


@pytest.mark.parametrize(
    ("request_", "mode", "backend", "message"),
    [
        (
            asking(enabled=True),
            None,
            "cpu-native",
            "start compute with --sparse-attention allow (or on) to let",
        ),
        (
            asking(enabled=True),
            None,
            "cpu",
            "and --attention-backend cpu-native (this stack's attention backend",
        ),
        (asking(enabled=True, topk=0), ALLOW, "cpu-native", "recent and topk >= 1"),
        (asking(enabled=True, sink=-2), ON, "cpu-native", "sink must be >= 0"),
        (asking(enabled=True, recent=0), ON, "cpu-native", "recent and topk >= 1"),
        (asking(enabled=False, topk=4), ON, "cpu-native", "sets topk with enabled false"),
    ],
)
def test_the_gateway_refuses_what_compute_cannot_serve(request_, mode, backend, message):
    with pytest.raises(InvalidArgument, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve(request_, info(mode, backend))


def test_the_clients_forms_of_the_field():
    assert not build_request("hi").HasField("sparse_attention")
    assert build_request("hi", sparse_attention=False).sparse_attention == generation_pb2.SparseAttention()
    sent = build_request("hi", sparse_attention={"topk": 4}).sparse_attention
    assert sent.enabled and sent.topk == 4 and not sent.HasField("sink")
    body = completion_request(parse(CompletionRequest, {"prompt": "hi", "sparse_attention": True}), "r")
    assert body.sparse_attention.enabled and not body.sparse_attention.HasField("topk")
    body = {"prompt": "hi", "sparse_attention": {"recent": 2, "topk": 5}}
    sent = completion_request(parse(CompletionRequest, body), "r").sparse_attention
    assert (sent.enabled, sent.recent, sent.topk, sent.HasField("sink")) == (True, 2, 5, False)
    assert not completion_request(parse(CompletionRequest, {"prompt": "hi"}), "r").HasField(
        "sparse_attention"
    )
    assert cli_sparse("on") is True and cli_sparse("off") is False
    assert cli_sparse("sink=0,topk=-1") == {"sink": 0, "topk": -1}, "the gateway judges the values"
    with pytest.raises(argparse.ArgumentTypeError, match="expected on, off or comma-separated"):
        cli_sparse("topk=2,topk=3")


def test_the_gateway_sends_rows_only_where_compute_has_block_sparse_decode():
    seqs = [
        gateway_seq(list(range(1, 11)), 9, 10, LIMITS.vocab_size),
        gateway_seq(list(range(1, 21)), 19, 20, LIMITS.vocab_size),
    ]
    tables = [[[1, 2, 3], [4, 5, 6, 7, 8, 9]]]  # one KV group
    assert len(gateway_request(seqs, tables, "e", frozenset()).sparse) == 0
    seqs[0].sparse, seqs[1].sparse = (1, 2, 3), DENSE
    request = gateway_request(seqs, tables, "e", frozenset())
    assert [(r.sink, r.recent, r.topk) for r in request.sparse] == [(1, 2, 3), (0, 0, 0)]
    batch = ForwardBatch.from_request(request, LIMITS)
    assert batch.sparse == [SparseAttention(1, 2, 3), None]
    following = batch.following(torch.tensor([5, 6]), [1], LIMITS.block_size)
    assert following.sparse == [None], "a multi-step decode's rows keep their settings"


def step(rows: list[tuple[int, int, int]], seqs: int = 2) -> compute_pb2.ForwardRequest:
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(seqs)]
    request = forward_request([[5]] * seqs, [30] * seqs, tables, block_size=4)
    request.sparse.extend(compute_pb2.SparseRow(sink=s, recent=r, topk=k) for s, r, k in rows)
    return request


@pytest.mark.parametrize(
    ("rows", "limits", "message", "refused"),
    [
        (
            [(1, 2, 3), (0, 0, 0)],
            Limits(100, 256, 64, 4),
            "start compute with --sparse-attention allow",
            (0,),
        ),
        ([(0, 0, 0), (-1, 2, 3)], LIMITS, r"sparse\[1\] = sink -1, recent 2, topk 3", (1,)),
        ([(1, 0, 3), (1, 2, -3)], LIMITS, r"sparse\[0\] = sink 1, recent 0, topk 3", (0, 1)),
    ],
)
def test_compute_refuses_rows_it_cannot_serve(rows, limits, message, refused):
    with pytest.raises(RowsRefused, match=message) as err:
        ForwardBatch.from_request(step(rows), limits)
    assert err.value.rows == refused
    ForwardBatch.from_request(step([(0, 0, 0), (0, 0, 0)]), limits)  # dense rows pass anywhere


def test_compute_refuses_a_row_count_that_is_not_the_steps():
    with pytest.raises(InvalidArgument, match="sparse has 1 entries for 2 sequences"):
        ForwardBatch.from_request(step([(1, 2, 3)]), LIMITS)
