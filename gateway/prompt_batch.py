"""A request of several prompts (GenerateRequest.prompts, a completions `prompt` list): one request per
prompt under the same controls, all checked before any starts, run at once, their responses merged into one
stream whose index numbers prompt p's sample i as p * n + i."""

import queue
from collections.abc import Iterator
from typing import TYPE_CHECKING

from common.errors import InvalidArgument
from gateway.limits import flag
from protos import generation_pb2

if TYPE_CHECKING:
    from gateway.started import Started


def split(request: generation_pb2.GenerateRequest, max_prompts: int) -> list[generation_pb2.GenerateRequest]:
    """The request of each prompt (the request itself when it has no `prompts`); INVALID_ARGUMENT naming the
    field for a list beside another prompt, with resume, too long, or with an entry that is not exactly one
    of text and token_ids."""
    if not request.prompts:
        return [request]
    others = [name for name in ("prompt", "token_ids", "messages") if getattr(request, name)]
    if others:
        raise InvalidArgument(f"set prompts or {others[0]}, not both")
    if request.resume:
        raise InvalidArgument("resume takes a request of one prompt: resume each prompt's stream on its own")
    if len(request.prompts) > max_prompts:
        raise InvalidArgument(
            f"prompts has {len(request.prompts)} entries; the limit is {max_prompts} ({flag('max_prompts')})"
        )
    parts = []
    for i, prompt in enumerate(request.prompts):
        if bool(prompt.text) == bool(prompt.token_ids):
            raise InvalidArgument(f"prompts[{i}] must set exactly one of text and token_ids")
        part = generation_pb2.GenerateRequest()
        part.CopyFrom(request)
        part.ClearField("prompts")
        if prompt.text:
            part.prompt = prompt.text
        else:
            part.token_ids.extend(prompt.token_ids)
        parts.append(part)
    return parts


class Tagged:
    """A prompt's outbox: what the engine puts in it arrives in the batch's one queue, tagged with the
    prompt's number."""

    def __init__(self, outbox: queue.Queue, number: int) -> None:
        self._outbox, self._number = outbox, number

    def put(self, item: object) -> None:
        self._outbox.put((self._number, item))


def merged(started: list["Started"], outbox: queue.Queue) -> Iterator[generation_pb2.GenerateResponse]:
    """The prompts' responses as they come, each index renumbered (prompt p's sample i: p * n + i), until
    every sample of every prompt finished; the first error of any prompt is raised (the call's end then
    aborts the others)."""
    running = sum(part.running for part in started)
    while running:
        number, item = outbox.get()
        part = started[number]
        left = part.running
        reply = part.reply(item)
        running -= left - part.running
        reply.index += number * part.seq.sampling.n
        yield reply
