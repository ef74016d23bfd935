"""gpt-oss's harmony response format, read as it streams: the assistant's output is a run of messages, each a
header (`<|channel|>analysis`, `assistant<|channel|>commentary to=functions.get_weather json`, ...) then
`<|message|>`, its body, and an end token (`<|end|>`, or `<|return|>` / `<|call|>`, which end the turn). The
prompt ends in `<|start|>assistant`, so the output's first header has no `<|start|>`; the later ones open
with it. Both the reasoning split (analysis apart) and the tool-call parser (calls from messages addressed
to functions) read their text with one `Messages` reader."""

import re
from dataclasses import dataclass

from gateway.tools.calls import partial

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
TOKENS = (START, CHANNEL, MESSAGE, CONSTRAIN, END, RETURN, CALL)
# What opens a header between messages (and, at the head of the output only, a recipient `to=` written
# before the channel), and what ends a body: an end token, or a header opened without one.
OPENS, CLOSES = (START, CHANNEL), (END, RETURN, CALL, START, CHANNEL)
RECIPIENT = re.compile(r"\bto=([^\s<]+)")
CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
# Where the reader is: between messages, in a header, in a body.
LOOSE, HEADER, BODY = "loose", "header", "body"


@dataclass(frozen=True, slots=True)
class Header:
    """A message's header: as written (from its `<|start|>` or `<|channel|>` up to `<|message|>`), its
    channel ("" if it names none) and its recipient ("" if none)."""

    text: str
    channel: str
    recipient: str


def header(text: str) -> Header:
    channel = CHANNEL_NAME.search(text)
    recipient = RECIPIENT.search(text)
    return Header(text, channel[1] if channel else "", recipient[1] if recipient else "")


ANALYSIS = header(CHANNEL + "analysis")


@dataclass(frozen=True, slots=True)
class Event:
    """`text` of the message under `header` (None: text outside any message). `opens`: the header is whole
    (the event has no text); `end`: the end token (`<|end|>`, `<|return|>`, `<|call|>`; "" for a body the
    output cut off or that another header ended) when the event closes its message."""

    header: Header | None
    text: str = ""
    end: str | None = None
    opens: bool = False


class Messages:
    """Reads one sample's output as it streams into events: loose text, the text of each message's body as
    it comes, each message's end. Text that may be the start of a token is held back until decided. A
    header is released whole (an event with its header and no text) once `<|message|>` ends it; one the
    output ends inside is loose text, as written. `opened`: the output starts inside an analysis body (the
    prompt opened it)."""

    def __init__(self, opened: bool = False) -> None:
        self._state = BODY if opened else LOOSE
        self._header = ANALYSIS if opened else None
        self._held = ""
        self._head = not opened

    def feed(self, text: str) -> list[Event]:
        self._held += text
        events: list[Event] = []
        while self._step(events):
            pass
        return events

    def finish(self) -> list[Event]:
        held, self._held = self._held, ""
        if self._state == BODY:
            return [Event(self._header, held, "")]
        return [Event(None, held)] if held else []

    def _step(self, events: list[Event]) -> bool:
        """Reads what the held text decides; whether there may be more to read."""
        if self._state == HEADER:
            cut = self._held.find(MESSAGE)
            if cut < 0:
                return False
            self._header = header(self._held[:cut])
            self._state, self._held = BODY, self._held[cut + len(MESSAGE) :]
            events.append(Event(self._header, opens=True))
            return True
        opens = CLOSES if self._state == BODY else OPENS
        if self._head and self._state == LOOSE:
            head = self._held.lstrip()
            if head.startswith("to="):
                self._head, self._state, self._held = False, HEADER, head
                return True
            if "to=".startswith(head):
                return False
        found = [(at, tag) for tag in opens if (at := self._held.find(tag)) >= 0]
        if not found:
            keep = max(partial(self._held, tag) for tag in opens)
            released, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
            if released:
                self._head = self._head and not released.strip()
                events.append(Event(self._header if self._state == BODY else None, released))
            return False
        at, tag = min(found)
        before, self._head = self._held[:at], False
        if self._state == BODY and tag in (END, RETURN, CALL):
            events.append(Event(self._header, before, tag))
            self._state, self._header, self._held = LOOSE, None, self._held[at + len(tag) :]
            return True
        if self._state == BODY:
            events.append(Event(self._header, before, ""))
        elif before:
            events.append(Event(None, before))
        self._state, self._header, self._held = HEADER, None, self._held[at:]
        return True
