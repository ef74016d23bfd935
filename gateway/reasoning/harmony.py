"""gpt-oss's reasoning (the harmony format, gateway.harmony): one sample's analysis messages split from its
answer as it streams."""

from gateway.harmony import CHANNEL, MESSAGE, Event, Messages


class HarmonySplit:
    """Splits a sample's harmony messages: the bodies of `analysis` messages are the reasoning; the bodies of
    the others (`final`, `commentary` preambles) and text outside any message are the answer. A message
    addressed to a recipient (a tool call) goes into the answer as a message (`<|channel|>commentary
    to=functions.NAME<|message|>` its body and end token) for the tool-call parser. The blanks at the head
    of the reasoning and of the answer are dropped. `opened`: the prompt opened an analysis message."""

    def __init__(self, opened: bool) -> None:
        self._messages = Messages(opened)
        self._reasoning_begun = False
        self._answer_begun = False

    def feed(self, text: str) -> tuple[str, str]:
        """The (reasoning, answer) released by `text`."""
        return self._split(self._messages.feed(text))

    def finish(self) -> tuple[str, str]:
        """What is still held at the end of the sample."""
        return self._split(self._messages.finish())

    def _split(self, events: list[Event]) -> tuple[str, str]:
        reasoning, answer = "", ""
        for event in events:
            head = event.header
            if head is not None and head.recipient:
                opening = f"{CHANNEL}{head.channel} to={head.recipient}{MESSAGE}" if event.opens else ""
                answer += opening + event.text + (event.end or "")
            elif head is not None and head.channel == "analysis":
                reasoning += self._reasoning(event.text)
            else:
                answer += event.text
        if answer and not self._answer_begun:
            answer = answer.lstrip()
            self._answer_begun = bool(answer)
        return reasoning, answer

    def _reasoning(self, text: str) -> str:
        if not self._reasoning_begun:
            text = text.lstrip()
            self._reasoning_begun = bool(text)
        return text
