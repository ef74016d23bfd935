"""The gateway's replies to a Messages request as Anthropic's message: content blocks (thinking, text,
tool_use, in the order the model wrote them), stop_reason and usage; streamed, the events of its stream
(message_start, content_block_start/delta/stop, message_delta, message_stop)."""

import json
import uuid
from collections.abc import Sequence

from protos import generation_pb2

STOP_REASONS = {
    generation_pb2.FINISH_REASON_LENGTH: "max_tokens",
    generation_pb2.FINISH_REASON_TOOL_CALLS: "tool_use",
}


class MessageOutput:
    """One message's content, grown reply by reply; `events(reply)` gives the stream's events for it.
    `stop_sequence(reply)` says which of the request's stop sequences ended it (None: another reason)."""

    def __init__(self, model: str, stop_sequence) -> None:
        self.id = f"msg_{uuid.uuid4().hex}"
        self._model = model
        self._stop_sequence = stop_sequence
        self.blocks: list[dict] = []
        self._open: dict | None = None
        self.stop_reason: str | None = None
        self.matched: str | None = None
        self._usage = generation_pb2.Usage()

    def message(self) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self._model,
            "content": self.blocks,
            "stop_reason": self.stop_reason,
            "stop_sequence": self.matched,
            "usage": self.usage(),
        }

    def usage(self) -> dict:
        u = self._usage
        return {
            "input_tokens": u.prompt_tokens - u.cached_tokens,
            "cache_read_input_tokens": u.cached_tokens,
            "cache_creation_input_tokens": 0,
            "output_tokens": u.completion_tokens,
        }

    # the stream
    def start(self) -> list[dict]:
        head = {**self.message(), "content": [], "usage": {"input_tokens": 0, "output_tokens": 0}}
        return [{"type": "message_start", "message": head}]

    def events(self, reply: generation_pb2.GenerateResponse) -> list[dict]:
        events = []
        if reply.reasoning_text:
            events += self._into("thinking")
            self._open["thinking"] += reply.reasoning_text
            events.append(self._delta({"type": "thinking_delta", "thinking": reply.reasoning_text}))
        if reply.text:
            events += self._into("text")
            self._open["text"] += reply.text
            events.append(self._delta({"type": "text_delta", "text": reply.text}))
        for call in reply.tool_calls:
            events += self._close()
            block = {"type": "tool_use", "id": call.id, "name": call.name, "input": _input(call.arguments)}
            self.blocks.append(block)
            index = len(self.blocks) - 1
            events += [
                {"type": "content_block_start", "index": index, "content_block": {**block, "input": {}}},
                {"type": "content_block_delta", "index": index,
                 "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}},
                {"type": "content_block_stop", "index": index},
            ]  # fmt: skip
        if reply.finish_reason:
            self._usage.CopyFrom(reply.usage)
            self.matched = self._stop_sequence(reply)
            reason = STOP_REASONS.get(reply.finish_reason, "end_turn")
            self.stop_reason = "stop_sequence" if self.matched else reason
        return events

    def end(self) -> list[dict]:
        delta = {"stop_reason": self.stop_reason, "stop_sequence": self.matched}
        return [
            *self._close(),
            {"type": "message_delta", "delta": delta, "usage": self.usage()},
            {"type": "message_stop"},
        ]

    def _into(self, kind: str) -> list[dict]:
        if self._open is not None and self._open["type"] == kind:
            return []
        events = self._close()
        block = (
            {"type": "thinking", "thinking": "", "signature": ""}
            if kind == "thinking"
            else {"type": "text", "text": ""}
        )
        self._open = block
        self.blocks.append(block)
        events.append(
            {"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)}
        )
        return events

    def _close(self) -> list[dict]:
        block, self._open = self._open, None
        if block is None:
            return []
        index = self.blocks.index(block)
        events = []
        if block["type"] == "thinking":
            events.append(self._delta({"type": "signature_delta", "signature": ""}, index))
        return [*events, {"type": "content_block_stop", "index": index}]

    def _delta(self, delta: dict, index: int | None = None) -> dict:
        index = len(self.blocks) - 1 if index is None else index
        return {"type": "content_block_delta", "index": index, "delta": delta}


def _input(arguments: str) -> dict:
    """A call's arguments as tool_use's `input` object (arguments that are no object: under `arguments`)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {"arguments": arguments}


def matched_stop(tail: str, stops: Sequence[str]) -> str | None:
    """The stop sequence found earliest in `tail` (the text of a sample's last tokens), if any."""
    found = [(tail.find(stop), stop) for stop in stops if stop and stop in tail]
    return min(found)[1] if found else None
