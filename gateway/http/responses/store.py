"""The responses kept for `previous_response_id`: per API key, the conversation each response ended (its
input messages and its output), in memory, bounded."""

import threading
from collections import OrderedDict
from collections.abc import Sequence

from protos import generation_pb2

# Responses kept, and chat messages kept over all of them; beyond either the oldest are dropped first.
MAX_RESPONSES = 1024
MAX_MESSAGES = 65536


class ResponseStore:
    """Conversations by (API key name, response id). NOTE: one gateway's memory: a restart forgets them and
    another gateway of the same stack does not know them."""

    def __init__(self, max_responses: int = MAX_RESPONSES, max_messages: int = MAX_MESSAGES) -> None:
        self._lock = threading.Lock()
        self._kept: OrderedDict[tuple[str, str], tuple[generation_pb2.ChatMessage, ...]] = OrderedDict()
        self._max_responses, self._max_messages = max_responses, max_messages
        self._messages = 0

    def put(self, tenant: str, response_id: str, messages: Sequence[generation_pb2.ChatMessage]) -> None:
        with self._lock:
            self._kept[tenant, response_id] = tuple(messages)
            self._messages += len(messages)
            while len(self._kept) > self._max_responses or self._messages > self._max_messages:
                _, dropped = self._kept.popitem(last=False)
                self._messages -= len(dropped)

    def get(self, tenant: str, response_id: str) -> tuple[generation_pb2.ChatMessage, ...] | None:
        """The conversation response_id ended; None if it is not kept (not stored, dropped, another key's)."""
        with self._lock:
            return self._kept.get((tenant, response_id))
