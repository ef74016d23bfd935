"""A resumed sample (GenerateRequest.resume) continues exactly where its stream broke: from any break point
its text deltas, stop and finish are the unbroken stream's; each sample keeps its own seed; a resume that is
no stream of the request is refused and changes nothing; a resume takes over its request id."""

import pytest
from transformers import AutoTokenizer

from common.errors import Aborted, InvalidArgument
from common.model_files import local_copy
from gateway import resume
from gateway.admission import Admission
from gateway.outputs import append_token
from gateway.sequence import Sampling, Sequence
from protos import generation_pb2

TEXT = "The quick brown fox jumps over the lazy dog. 東京 and café 🦙! Done."
PROMPT = [1, 2, 3, 4, 5]
MAX_LEN = 4096
ResumedSample = generation_pb2.ResumedSample


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(local_copy("smollm2").path)


@pytest.fixture(scope="module")
def tokens(tokenizer) -> list[int]:
    return tokenizer.encode(TEXT, add_special_tokens=False)


def eos(tokenizer) -> frozenset[int]:
    return frozenset({tokenizer.eos_token_id})


def first(sampling: Sampling, request_id: str = "r") -> Sequence:
    return Sequence(
        seq_id="q", prompt_ids=list(PROMPT), sampling=sampling, max_len=MAX_LEN, request_id=request_id
    )


def generate(seq: Sequence, tokens: list[int], tokenizer) -> tuple[list[str], str | None]:
    """The text deltas of `tokens` appended one by one as the engine does, until the sequence ends."""
    deltas = []
    for token in tokens:
        deltas.append(append_token(seq, token, eos(tokenizer), tokenizer))
        if seq.finish_reason:
            break
    return deltas, seq.finish_reason


def resumed_samples(sampling: Sampling, received: list[ResumedSample], tokenizer) -> resume.Samples:
    return resume.samples(first(sampling), received, eos(tokenizer), tokenizer, len(tokenizer))


def resumed(sampling: Sampling, received: list[ResumedSample], tokenizer) -> list[Sequence]:
    return resumed_samples(sampling, received, tokenizer).seqs


# Each ends before the text runs out (the plain one at its last token).
CASES = {
    "plain": lambda tokens: Sampling(max_tokens=len(tokens), ignore_eos=True),
    "stop string": lambda tokens: Sampling(max_tokens=64, stop=("lazy d",)),
    "stop string held before min_tokens": lambda tokens: Sampling(max_tokens=64, stop=("o",), min_tokens=9),
    "stop token after min_tokens": lambda tokens: Sampling(
        max_tokens=64, min_tokens=4, stop_token_ids=frozenset({tokens[2], tokens[9]})
    ),
    "max_tokens, in a character": lambda tokens: Sampling(max_tokens=11),
}


@pytest.mark.parametrize("case", list(CASES))
def test_from_every_break_point_the_deltas_and_the_finish_are_the_unbroken_streams(case, tokenizer, tokens):
    sampling = CASES[case](tokens)
    deltas, reason = generate(first(sampling), tokens, tokenizer)
    assert reason is not None, "each case ends before the text runs out"
    for k in range(len(deltas)):
        samples = resumed_samples(sampling, [ResumedSample(index=0, token_ids=tokens[:k])], tokenizer)
        (seq,) = samples.seqs
        assert seq.output_ids == tokens[:k] and seq.num_computed == 0, "the received tokens are prefilled"
        assert samples.texts == {0: "".join(deltas[:k])}, "the text its client has, for the tool-call parser"
        assert generate(seq, tokens[k:], tokenizer) == (deltas[k:], reason), f"broken after {k} tokens"


def test_a_resume_whose_tokens_already_end_the_sample_is_refused(tokenizer, tokens):
    sampling = Sampling(max_tokens=64, stop=("lazy d",))
    deltas, _ = generate(first(sampling), tokens, tokenizer)
    with pytest.raises(InvalidArgument, match=f"token {len(deltas)} of {len(deltas)} ends it \\(stop\\)"):
        resumed(sampling, [ResumedSample(index=0, token_ids=tokens[: len(deltas)])], tokenizer)
    with pytest.raises(InvalidArgument, match="ends it \\(length\\)"):
        resumed(Sampling(max_tokens=3), [ResumedSample(index=0, token_ids=tokens[:3])], tokenizer)


def test_each_resumed_sample_runs_alone_with_its_own_seed(tokenizer, tokens):
    sampling = Sampling(max_tokens=32, n=4, seed=2**64 - 2, ignore_eos=True)
    received = [
        ResumedSample(index=2, token_ids=tokens[:5]),
        ResumedSample(index=1, token_ids=tokens[:7], finished=True),
        ResumedSample(index=0, token_ids=tokens[:3]),
    ]
    seqs = resumed(sampling, received, tokenizer)
    assert [seq.index for seq in seqs] == [0, 2, 3], "the finished sample is not generated again"
    assert [seq.sampling.seed for seq in seqs] == [2**64 - 2, 0, 1], "seed + index, as a forked sample"
    assert [len(seq.output_ids) for seq in seqs] == [3, 5, 0]
    assert all(seq.sampling.n == 1 and not seq.forks_now for seq in seqs), "no sample forks the others"
    assert [seq.seq_id for seq in seqs] == ["q", "q/2", "q/3"]
    assert {seq.group_id for seq in seqs} == {"q"} and len({id(seq.outbox) for seq in seqs}) == 1
    assert resume.finished_tokens(received) == 7
    unseeded = resumed(Sampling(max_tokens=8, n=2), [ResumedSample(index=1, token_ids=tokens[:2])], tokenizer)
    assert [seq.sampling.seed for seq in unseeded] == [None, None]


@pytest.mark.parametrize(
    ("received", "message"),
    [
        ([ResumedSample(index=2)], "resume\\[0\\].index is 2: the request has samples 0..1"),
        ([ResumedSample(index=-1)], "resume\\[0\\].index is -1"),
        ([ResumedSample(index=1), ResumedSample(index=1)], "resume\\[1\\]: sample 1 is listed twice"),
        ([ResumedSample(index=0, token_ids=[10**6])], "resume\\[0\\].token_ids: token id 1000000 is outside"),
        (
            [ResumedSample(index=0, finished=True), ResumedSample(index=1, finished=True)],
            "nothing to generate",
        ),
        ([ResumedSample(index=0, token_ids=[7] * (MAX_LEN - len(PROMPT)))], "at most 4096 fit a sequence"),
    ],
)
def test_a_resume_that_is_no_stream_of_the_request_is_refused(tokenizer, received, message):
    with pytest.raises(InvalidArgument, match=message):
        resumed(Sampling(max_tokens=MAX_LEN, n=2, ignore_eos=True), received, tokenizer)


def test_a_resume_takes_over_the_running_request_of_its_id_and_key():
    admission = Admission()
    mine, other_key, other_id = (first(Sampling(), request_id=rid) for rid in ("r", "r", "s"))
    other_key.seq_id, other_key.tenant, other_id.seq_id = "k", "someone-else", "i"
    for seq in (mine, other_key, other_id):
        admission.enter(seq)
    assert resume.take_over(admission, "r", "") == 1
    error = mine.outbox.get_nowait()
    assert isinstance(error, Aborted) and "request r was resumed by another call" in str(error)
    assert other_key.outbox.empty() and other_id.outbox.empty()
