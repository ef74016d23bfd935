"""The responses kept (unless `store` is false): per API key, each response as it was answered, its input
items, and the conversation it ended (its input messages and its output) for `previous_response_id`; in
memory, bounded."""

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

from protos import generation_pb2

# Responses kept, and chat messages kept over all of them; beyond either the oldest are dropped first.
MAX_RESPONSES = 1024
MAX_MESSAGES = 65536


class Stored(NamedTuple):
    """A response object as answered, the input items of its request, and the conversation it ended."""

    response: dict
    input_items: tuple[dict, ...]
    conversation: tuple[generation_pb2.ChatMessage, ...]


class ResponseStore:
    """Responses by (API key name, response id). NOTE: one gateway's memory: a restart forgets them and
    another gateway of the same stack does not know them."""

    def __init__(self, max_responses: int = MAX_RESPONSES, max_messages: int = MAX_MESSAGES) -> None:
        self._lock = threading.Lock()
        self._kept: OrderedDict[tuple[str, str], Stored] = OrderedDict()
        self._max_responses, self._max_messages = max_responses, max_messages
        self._messages = 0

    def put(
        self,
        tenant: str,
        response: dict,
        input_items: Sequence[dict],
        conversation: Sequence[generation_pb2.ChatMessage],
    ) -> None:
        with self._lock:
            kept = Stored(response, tuple(input_items), tuple(conversation))
            self._kept[tenant, response["id"]] = kept
            self._messages += _size(kept)
            while len(self._kept) > self._max_responses or self._messages > self._max_messages:
                _, dropped = self._kept.popitem(last=False)
                self._messages -= _size(dropped)

    def get(self, tenant: str, response_id: str) -> Stored | None:
        """The response kept under response_id; None if it is not kept (not stored, dropped, deleted,
        another key's)."""
        with self._lock:
            return self._kept.get((tenant, response_id))

    def delete(self, tenant: str, response_id: str) -> bool:
        """Forgets the response; whether it was kept."""
        with self._lock:
            dropped = self._kept.pop((tenant, response_id), None)
            if dropped is not None:
                self._messages -= _size(dropped)
            return dropped is not None


def _size(kept: Stored) -> int:
    """What a response counts against MAX_MESSAGES: its conversation's messages and its input items."""
    return len(kept.conversation) + len(kept.input_items)
