"""What the engine hands to the RPC threads: a step's sampled tokens appended to their sequences (text
released, finish reason set) as Outputs, or an error that ends a request's stream."""

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from common.errors import PagedServeError
from gateway.sequence import Sequence
from gateway.text_stream import TextStream
from gateway.tokenizer import Detokenizer
from protos import generation_pb2

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(slots=True)
class Output:
    token_ids: list[int]
    finish_reason: str | None
    index: int = 0
    # Text released by these tokens (see TextStream), and per token its logprobs when asked.
    text: str = ""
    logprobs: list[generation_pb2.TokenLogprobs] | None = None
    # An embedding input's pooled hidden states (gateway.pooled), on its one Output.
    embedding: np.ndarray | None = None


def append_token(seq: Sequence, token: int, eos: frozenset[int], tokenizer: "PreTrainedTokenizerBase") -> str:
    """Adds the token, sets finish_reason (stop strings first) and returns the text it releases. (A resumed
    sample's received tokens go through here too, one by one, so its text and stop state are the unbroken
    stream's: gateway.resume.)"""
    seq.output_ids.append(token)
    if seq.constraint is not None:
        seq.constraint.accept(token)
    if seq.text is None:  # made at the first token, so forked samples get their own
        seq.text = TextStream(Detokenizer(tokenizer), seq.sampling.stop)
    text = seq.text.append([token], match=seq.reached_min_tokens)
    seq.finish_reason = "stop" if seq.text.stopped else seq.stop_reason(eos)
    if seq.finish_reason:
        text += seq.text.finish(match=seq.reached_min_tokens)
    return text


def tell(seqs: list[Sequence], error: PagedServeError) -> None:
    """Ends the requests' streams with the error (once per request: the RPC thread raises the first)."""
    for outbox in {id(seq.outbox): seq.outbox for seq in seqs}.values():
        outbox.put(error)


def by_request(seqs: list[Sequence]) -> dict[str, list[Sequence]]:
    groups: dict[str, list[Sequence]] = {}
    for seq in seqs:
        groups.setdefault(seq.request_id, []).append(seq)
    return groups
