"""Pooling: what a model directory declares (sentence-transformers' modules.json and Pooling config, both its
formats) and --pooling; compute's pooling of packed rows against sentence-transformers' Pooling module on
padded batches; the Forward checks of pooling rows; the gateway's sums of an input's chunks."""

import json

import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from common.errors import RowsRefused
from compute_service.batch import ForwardBatch
from compute_service.pooling import UnsupportedPooling, pool, resolve
from compute_service.validation import Limits
from gateway.pooled import pooled_rows, take_pooled
from gateway.sequence import Sampling, Sequence
from protos import compute_pb2
from tests.forward import forward_request

TRANSFORMER = "sentence_transformers.base.modules.transformer.Transformer"
POOLING = "sentence_transformers.sentence_transformer.modules.pooling.Pooling"
NORMALIZE = "sentence_transformers.base.modules.normalize.Normalize"
CONFIG = LlamaConfig(hidden_size=64)


def _declare(path, pooling_config: dict, *extra: str, normalize: bool = True, text_only: bool = True):
    modules = [{"path": "", "type": TRANSFORMER}, {"path": "1_Pooling", "type": POOLING}]
    modules += [{"path": "2_Normalize", "type": NORMALIZE}] if normalize else []
    modules += [{"path": f"{i}_X", "type": kind} for i, kind in enumerate(extra, 3)]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
    modalities = {"text": {}} if text_only else {"text": {}, "message": {"format": "flat"}}
    (path / "sentence_bert_config.json").write_text(json.dumps({"modality_config": modalities}))
    return path


@pytest.mark.parametrize(
    ("settings", "mode"),
    [
        ({"pooling_mode": "lasttoken", "include_prompt": True}, "last"),
        ({"pooling_mode": ["mean"]}, "mean"),
        ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, "cls"),  # before version 6
        ({"pooling_mode_lasttoken": True}, "last"),
    ],
)
def test_the_declared_mode_and_normalize_are_read(tmp_path, settings, mode):
    declared = resolve("auto", _declare(tmp_path, settings), CONFIG)
    assert (declared.mode, declared.normalize, declared.dimensions, declared.source) == (
        mode, True, 64, "modules.json"
    )  # fmt: skip
    assert not resolve("auto", _declare(tmp_path, settings, normalize=False), CONFIG).normalize


@pytest.mark.parametrize(
    ("settings", "extra", "text_only", "says"),
    [
        ({"pooling_mode": "max"}, (), True, "pools by one of lasttoken, mean or cls"),
        ({"pooling_mode": ["mean", "cls"]}, (), True, "pools by one of"),
        ({"pooling_mode": "mean", "include_prompt": False}, (), True, "prompt included"),
        ({"pooling_mode": "mean"}, ("sentence_transformers.models.Dense",), True, "no Dense"),
        ({"pooling_mode": "lasttoken"}, (), False, "chat template"),
    ],
)
def test_a_pooling_pagedserve_cannot_follow_is_refused_saying_what_it_runs(
    tmp_path, settings, extra, text_only, says
):
    with pytest.raises(UnsupportedPooling, match=says):
        resolve("auto", _declare(tmp_path, settings, *extra, text_only=text_only), CONFIG)


def test_the_flag_sets_or_turns_off_pooling(tmp_path):
    assert resolve("auto", tmp_path, CONFIG) is None  # a plain decoder does not pool unless told
    plain = resolve("last", tmp_path, CONFIG)
    assert (plain.mode, plain.normalize, plain.source, plain.matryoshka) == ("last", True, "--pooling", None)
    declared = _declare(tmp_path, {"pooling_mode": "lasttoken"}, normalize=False)
    assert resolve("off", declared, CONFIG) is None
    assert resolve("mean", declared, CONFIG).normalize is False  # the model's lack of Normalize stays


def test_matryoshka_comes_from_the_config(tmp_path):
    assert resolve("last", tmp_path, LlamaConfig(hidden_size=64, is_matryoshka=True)).matryoshka == ()
    widths = LlamaConfig(hidden_size=64, matryoshka_dimensions=[32, 16])
    assert resolve("last", tmp_path, widths).matryoshka == (16, 32)


@pytest.mark.parametrize(("mode", "st_mode"), [("last", "lasttoken"), ("mean", "mean"), ("cls", "cls")])
def test_packed_rows_pool_as_sentence_transformers_pools_padded_ones(mode, st_mode):
    from sentence_transformers.sentence_transformer.modules import Pooling

    torch.manual_seed(0)
    lengths = [5, 1, 9, 3]
    hidden = torch.randn(sum(lengths), 8)
    cu = torch.tensor([0, *np.cumsum(lengths)])
    rows = [0, 2, 3]
    got = pool(mode, hidden, cu, rows)
    padded = torch.zeros(len(rows), max(lengths), 8)
    mask = torch.zeros(len(rows), max(lengths), dtype=torch.int64)
    for i, row in enumerate(rows):
        padded[i, : lengths[row]] = hidden[cu[row] : cu[row + 1]]
        mask[i, : lengths[row]] = 1
    features = {"token_embeddings": padded, "attention_mask": mask}
    expected = Pooling(8, pooling_mode=st_mode)(features)["sentence_embedding"]
    if mode == "mean":  # compute returns the sum: the gateway divides once every chunk is in
        got = got / torch.tensor([lengths[row] for row in rows])[:, None]
    # float32 sums of at most 9 terms: a few ulps
    assert torch.allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_forward_refuses_pooling_rows_naming_them():
    request = forward_request(
        [[1, 2, 3], [4, 5], [6]], [0, 4, 0], [[0, 1], [2, 3], [4]], block_size=4, sample=[False, False, True]
    )
    request.pool.extend([True, True, False])
    limits = Limits(vocab_size=100, max_model_len=64, num_blocks=8, block_size=4)
    with pytest.raises(RowsRefused, match="does not pool") as refused:
        ForwardBatch.from_request(request, limits)
    assert refused.value.rows == (0, 1)
    with pytest.raises(RowsRefused, match="starts at token 4") as refused:
        ForwardBatch.from_request(request, Limits(100, 64, 8, 4, pooling="cls"))
    assert refused.value.rows == (1,)
    request.pool[2] = True
    with pytest.raises(RowsRefused, match="both pools and samples") as refused:
        ForwardBatch.from_request(request, Limits(100, 64, 8, 4, pooling="last"))
    assert refused.value.rows == (2,)
    request.pool[2] = False
    assert ForwardBatch.from_request(request, Limits(100, 64, 8, 4, pooling="mean")).pool_rows == [0, 1]


def _input(mode: str, tokens: int) -> Sequence:
    prompt = list(range(tokens))
    return Sequence(seq_id=mode, prompt_ids=prompt, sampling=Sampling(), max_len=64, pooling=mode)


@pytest.mark.parametrize("mode", ["last", "mean", "cls"])
def test_an_input_in_chunks_ends_with_its_pooled_vector(mode):
    """Chunks of 4, 4 and 2 tokens: mean adds every chunk's sum, cls keeps the first chunk's, last the last
    chunk's; the input ends after its last chunk, whichever pooled."""
    seq, chunks, vectors = _input(mode, 10), [(0, 4), (4, 8), (8, 10)], []
    for start, end in chunks:
        seq.num_computed, seq.chunk_end = start, end
        rows = pooled_rows([seq])
        vector = np.full(3, float(end), dtype="<f4")
        vectors += [vector] if rows else []
        reply = compute_pb2.ForwardResponse(pooled=vector.tobytes() if rows else b"")
        seq.num_computed = end
        outputs = take_pooled([seq], rows, reply, faulty := [])
        assert not faulty and len(outputs) == (end == 10) and seq.samples_now is False
    expected = {"last": vectors[-1], "cls": vectors[0], "mean": sum(vectors) / 10}[mode]
    assert len(vectors) == {"last": 1, "cls": 1, "mean": 3}[mode]
    assert np.array_equal(outputs[0][1].embedding, expected) and outputs[0][1].finish_reason == "stop"


def test_pooled_values_that_do_not_fit_fail_that_input_alone():
    seqs = [_input("last", 4), _input("last", 3)]
    for seq in seqs:
        seq.chunk_end = seq.num_tokens
    faulty = []
    outputs = take_pooled(seqs, seqs, compute_pb2.ForwardResponse(pooled=b"\0" * 12), faulty)
    assert outputs == [] and [seq for seq, _ in faulty] == seqs
