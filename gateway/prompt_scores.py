"""Prompt log-probabilities in the gateway: the scores compute returns with each step of a prompt that asked
for them (ForwardResponse.prompt_*) kept by position on the sequence, and handed on with its first token."""

from gateway.sequence import Sequence
from protos import compute_pb2, generation_pb2


def collect(seqs: list[Sequence], reply: compute_pb2.ForwardResponse) -> None:
    """Stores the step's scores in the sequences that score their prompt (before their progress moves on: a
    row's targets are the prompt tokens after its chunk's tokens). A prompt computed again (preempted before
    its first token) overwrites its scores with the same ones."""
    width, at = reply.prompt_top_width, 0
    for seq in seqs:
        if not seq.scores_prompt:
            continue
        if seq.prompt_scores is None:
            seq.prompt_scores = [None] * len(seq.prompt_ids)
        first, top = seq.num_computed + 1, seq.sampling.prompt_logprobs
        for position, token in enumerate(seq.prompt_ids[first : seq.chunk_end + 1], start=first):
            row = slice(at * width, at * width + top)
            seq.prompt_scores[position] = generation_pb2.TokenLogprobs(
                token_id=token,
                logprob=reply.prompt_logprobs[at],
                rank=reply.prompt_ranks[at],
                top_token_ids=reply.prompt_top_token_ids[row],
                top_logprobs=reply.prompt_top_logprobs[row],
            )
            at += 1


def handed(seq: Sequence) -> list[generation_pb2.TokenLogprobs]:
    """What goes with sample 0's first token when it asked: every prompt token's score but the first's."""
    scores = seq.prompt_scores or [None]
    assert None not in scores[1:], (seq.seq_id, "a prompt token was not scored")
    return scores[1:]
