"""The reasoning in a request's streamed samples: each response's text split into its reasoning_text and its
answer (`text`), before tool calls are read from the answer."""

from collections.abc import Mapping

from gateway.reasoning.formats import ReasoningFormat
from gateway.reasoning.harmony import HarmonySplit
from gateway.reasoning.split import ReasoningSplit
from protos import generation_pb2


class ReasoningStreams:
    """One splitter per sample. A resumed request's samples go on from the text their client received
    (`received`, by sample); `answers` is the answer part of that text, by sample."""

    def __init__(self, fmt: ReasoningFormat, opened: bool, received: Mapping[int, str] | None = None) -> None:
        self._fmt, self._opened = fmt, opened
        self._splits: dict[int, ReasoningSplit | HarmonySplit] = {}
        self.answers = {index: self._split(index).feed(text)[1] for index, text in (received or {}).items()}

    def apply(self, reply: generation_pb2.GenerateResponse) -> None:
        """Moves the reasoning out of the reply's text into its reasoning_text (in place)."""
        split = self._split(reply.index)
        reasoning, answer = split.feed(reply.text)
        if reply.finish_reason:
            more, rest = split.finish()
            reasoning, answer = reasoning + more, answer + rest
        reply.reasoning_text, reply.text = reasoning, answer

    def _split(self, index: int) -> ReasoningSplit | HarmonySplit:
        if index not in self._splits:
            fmt, opened = self._fmt, self._opened
            self._splits[index] = HarmonySplit(opened) if fmt.channels else ReasoningSplit(fmt, opened)
        return self._splits[index]
