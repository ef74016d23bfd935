"""gpt-oss's tool calls in the harmony format (vLLM's `openai`, gateway.harmony): a call is a message
addressed to a function, `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>` then the
arguments as JSON and `<|call|>` (the recipient may come before `<|channel|>` instead:
`<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>`). The bodies of the other
messages (final answers, commentary preambles; analysis where the reasoning is not split) are content."""

import json
from collections.abc import Mapping

from gateway import harmony
from gateway.harmony import CHANNEL, CONSTRAIN, MESSAGE, Event, Header, Messages
from gateway.structured.lark import Tags
from gateway.tools.calls import Call, new_id

FUNCTIONS = "functions."
MARKERS = harmony.TOKENS


def grammar(functions: list[tuple[str, dict]], many: bool, tags: Tags) -> str:
    """One call of these functions: a call ends the model's turn (`<|call|>` is an end-of-turn token), so
    `many` allows no second one."""
    calls = " | ".join(
        f"{tags.literal(f'{CHANNEL}commentary to={FUNCTIONS}{name} {CONSTRAIN}json{MESSAGE}')} "
        f"%json {json.dumps(parameters, ensure_ascii=False)}"
        for name, parameters in functions
    )
    return f"start: {calls}\n"


class Parser:
    """Content and calls from a sample's harmony messages as they stream: a message to `functions.NAME` is
    released as a call once it ends (an output that ends in it ends it) if its body is a JSON object, else it
    is content as written; text outside messages and the bodies of other messages (to no recipient, or to a
    built-in tool: `browser.search`, `python`) are content."""

    def __init__(self, schemas: Mapping[str, dict] | None = None) -> None:
        self._messages = Messages()
        self._body = ""

    def feed(self, text: str) -> tuple[str, list[Call]]:
        return self._read(self._messages.feed(text))

    def finish(self) -> tuple[str, list[Call]]:
        return self._read(self._messages.finish())

    def _read(self, events: list[Event]) -> tuple[str, list[Call]]:
        content, calls = "", []
        for event in events:
            head = event.header
            if head is None or not head.recipient.startswith(FUNCTIONS):
                content += event.text
                continue
            self._body += event.text
            if event.end is None:
                continue
            body, self._body = self._body, ""
            call = _call(head, body)
            if call is None:
                content += head.text + MESSAGE + body + event.end
            else:
                calls.append(call)
        return content, calls


def _call(head: Header, body: str) -> Call | None:
    try:
        arguments = json.loads(body)
    except ValueError:
        return None
    name = head.recipient.removeprefix(FUNCTIONS)
    if not isinstance(arguments, dict) or not name:
        return None
    return Call(new_id(), name, json.dumps(arguments, ensure_ascii=False))
