"""One sample's text split into reasoning and answer as it streams."""

from gateway.reasoning.formats import ReasoningFormat

# Where the splitter is: nothing decided yet, in the reasoning, in the answer.
BEFORE, REASONING, ANSWER = "before", "reasoning", "answer"


class ReasoningSplit:
    """Splits a sample's text: a start tag at its head (after blanks) opens the reasoning, which runs up to
    the end tag; the rest is the answer. Text that may be the start of a tag is held back until decided; the
    blanks around the reasoning and at the head of the answer are dropped. `opened`: the prompt opened the
    reasoning, so the text starts inside it (a start tag the model writes again at its head is dropped). A
    sample that never closes its reasoning (max_tokens reached) is all reasoning; one that does not start
    with the tag is all answer."""

    def __init__(self, fmt: ReasoningFormat, opened: bool) -> None:
        self._fmt = fmt
        self._state = BEFORE
        self._opened = opened
        self._held = ""
        self._reasoning_begun = False
        self._answer_begun = False

    def feed(self, text: str) -> tuple[str, str]:
        """The (reasoning, answer) released by `text`."""
        self._held += text
        reasoning = ""
        if self._state == BEFORE:
            head = self._held.lstrip()
            if head.startswith(self._fmt.start):
                self._state, self._held = REASONING, head[len(self._fmt.start) :]
            elif self._fmt.start.startswith(head):
                return "", ""
            else:
                self._state = REASONING if self._opened else ANSWER
        if self._state == REASONING:
            end = self._held.find(self._fmt.end)
            if end < 0:
                keep = _partial(self._held, self._fmt.end)
                released, kept = self._reasoning(self._held[: len(self._held) - keep], final=False)
                self._held = kept + self._held[len(self._held) - keep :]
                return released, ""
            reasoning, _ = self._reasoning(self._held[:end], final=True)
            self._state, self._held = ANSWER, self._held[end + len(self._fmt.end) :]
        held, self._held = self._held, ""
        return reasoning, self._answer(held)

    def finish(self) -> tuple[str, str]:
        """What is still held at the end of the sample."""
        held, self._held = self._held, ""
        if self._state == REASONING or (self._state == BEFORE and self._opened):
            return self._reasoning(held, final=True)[0], ""
        return "", self._answer(held)

    def _reasoning(self, text: str, final: bool) -> tuple[str, str]:
        """(released, kept back) of reasoning text: its head's blanks dropped, its trailing blanks kept back
        (they may end the reasoning) unless `final`, then dropped."""
        if not self._reasoning_begun:
            text = text.lstrip()
            self._reasoning_begun = bool(text)
        body = text.rstrip()
        return body, "" if final else text[len(body) :]

    def _answer(self, text: str) -> str:
        if not self._answer_begun:
            text = text.lstrip()
            self._answer_begun = bool(text)
        return text


def _partial(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:n])), 0)
