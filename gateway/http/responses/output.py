"""The gateway's replies to a Responses request as a Response object: its output items (a reasoning item,
a message, function calls, in the order the model wrote them), status and usage; streamed, the typed
events of the openai SDK (`response.created` ... `response.output_text.delta` ... `response.completed`)."""

import time

from gateway.http.responses.request import ResponsesRequest, new_id
from protos import generation_pb2


class ResponseOutput:
    """One response's output, grown reply by reply; `events(reply)` gives the stream's events for it."""

    def __init__(self, body: ResponsesRequest, model: str, previous: str | None) -> None:
        self.id = new_id("resp")
        self._body, self._model, self._previous = body, model, previous
        self.created = int(time.time())
        self.items: list[dict] = []
        self._open: dict | None = None
        self._sequence = 0
        self._finish = generation_pb2.FINISH_REASON_UNSPECIFIED
        self._usage = generation_pb2.Usage()

    # the response object
    def response(self, status: str | None = None) -> dict:
        status = status or self.status
        body = self._body
        fmt = (
            body.text.format.model_dump(by_alias=True, exclude_none=True)
            if body.text and body.text.format
            else None
        )
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": self._model,
            "output": self.items if status != "in_progress" else [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": self._previous,
            "reasoning": {"effort": None, "summary": None},
            "store": body.store,
            "temperature": body.temperature,
            "text": {"format": fmt or {"type": "text"}},
            "tool_choice": _tool_choice(body),
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or ()],
            "top_p": body.top_p,
            "truncation": "disabled",
            "usage": self.usage() if status != "in_progress" else None,
            "user": body.user,
            "metadata": body.metadata or {},
        }

    @property
    def status(self) -> str:
        return "incomplete" if self._finish == generation_pb2.FINISH_REASON_LENGTH else "completed"

    def usage(self) -> dict:
        u = self._usage
        return {
            "input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens,
        }

    def text(self) -> str:
        return "".join(
            part["text"] for item in self.items if item["type"] == "message" for part in item["content"]
        )

    def calls(self) -> list[dict]:
        return [item for item in self.items if item["type"] == "function_call"]

    # the stream
    def start(self) -> list[dict]:
        return [
            self._event("response.created", response=self.response("in_progress")),
            self._event("response.in_progress", response=self.response("in_progress")),
        ]

    def events(self, reply: generation_pb2.GenerateResponse) -> list[dict]:
        """The events of one reply (its reasoning, text and calls, in that order); the items grow with it."""
        events = []
        if reply.reasoning_text:
            events += self._into("reasoning")
            self._open["content"][0]["text"] += reply.reasoning_text
            events.append(self._delta("response.reasoning_text.delta", reply.reasoning_text))
        if reply.text:
            events += self._into("message")
            self._open["content"][0]["text"] += reply.text
            events.append(self._delta("response.output_text.delta", reply.text, logprobs=[]))
        for call in reply.tool_calls:
            events += self._close()
            item = {"type": "function_call", "id": new_id("fc"), "call_id": call.id, "name": call.name,
                    "arguments": call.arguments, "status": "completed"}  # fmt: skip
            index = len(self.items)
            self.items.append(item)
            where = {"item_id": item["id"], "output_index": index}
            events += [
                self._event("response.output_item.added", output_index=index, item={**item, "arguments": ""}),
                self._event("response.function_call_arguments.delta", **where, delta=call.arguments),
                self._event("response.function_call_arguments.done", **where, arguments=call.arguments),
                self._event("response.output_item.done", output_index=index, item=item),
            ]
        if reply.finish_reason:
            self._finish = reply.finish_reason
            self._usage.CopyFrom(reply.usage)
        return events

    def end(self) -> list[dict]:
        """The last events: the open item closed, then `response.completed` (or `.incomplete`)."""
        events = self._close()
        kind = "response.completed" if self.status == "completed" else "response.incomplete"
        return [*events, self._event(kind, response=self.response())]

    def failed(self, code: str, message: str, param: str | None) -> dict:
        return self._event("error", code=code, message=message, param=param)

    def _into(self, kind: str) -> list[dict]:
        """Events opening an item of `kind` (closing the open one first) unless it is open already."""
        if self._open is not None and self._open["type"] == kind:
            return []
        events = self._close()
        if kind == "reasoning":
            part = {"type": "reasoning_text", "text": ""}
            item = {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": [part]}
        else:
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item = {"type": "message", "id": new_id("msg"), "status": "completed", "role": "assistant",
                    "content": [part]}  # fmt: skip
        self._open = item
        self.items.append(item)
        index = len(self.items) - 1
        events.append(self._event("response.output_item.added", output_index=index, item=_empty(item)))
        if kind == "message":
            events.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                      content_index=0, part={**part, "text": ""}))  # fmt: skip
        return events

    def _close(self) -> list[dict]:
        item, self._open = self._open, None
        if item is None:
            return []
        index, part = self.items.index(item), item["content"][0]
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "reasoning":
            events = [self._event("response.reasoning_text.done", **where, text=part["text"])]
        else:
            events = [
                self._event("response.output_text.done", **where, text=part["text"], logprobs=[]),
                self._event("response.content_part.done", **where, part=part),
            ]
        return [*events, self._event("response.output_item.done", output_index=index, item=item)]

    def _delta(self, kind: str, delta: str, **more) -> dict:
        index = len(self.items) - 1
        return self._event(
            kind, item_id=self._open["id"], output_index=index, content_index=0, delta=delta, **more
        )

    def _event(self, kind: str, **fields) -> dict:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence - 1, **fields}


def _empty(item: dict) -> dict:
    """An item as its stream announces it: no text yet (a message in progress)."""
    if item["type"] == "message":
        return {**item, "status": "in_progress", "content": []}
    return {**item, "content": [{**item["content"][0], "text": ""}]}


def _tool_choice(body: ResponsesRequest) -> str | dict:
    if body.tool_choice is None:
        return "auto"
    return body.tool_choice if isinstance(body.tool_choice, str) else body.tool_choice.model_dump()
