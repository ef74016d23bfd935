"""The Responses API's store: kept per API key, bounded by responses and by messages, deleted on request."""

from gateway.http.responses.store import ResponseStore
from protos import generation_pb2


def kept(store: ResponseStore, tenant: str, response_id: str, messages: int = 1) -> None:
    conversation = [generation_pb2.ChatMessage(role="user", content=str(i)) for i in range(messages)]
    store.put(tenant, {"id": response_id}, [{"id": "msg_1"}], conversation)


def test_a_response_is_kept_under_its_key_only():
    store = ResponseStore()
    kept(store, "a", "resp_1", messages=2)
    stored = store.get("a", "resp_1")
    assert stored.response == {"id": "resp_1"} and stored.input_items == ({"id": "msg_1"},)
    assert [m.content for m in stored.conversation] == ["0", "1"]
    assert store.get("b", "resp_1") is None


def test_the_oldest_go_first_past_either_bound():
    by_count = ResponseStore(max_responses=2)
    for i in range(3):
        kept(by_count, "a", f"resp_{i}")
    assert by_count.get("a", "resp_0") is None and by_count.get("a", "resp_2") is not None
    # each response counts its conversation's messages and its input items
    by_messages = ResponseStore(max_messages=7)
    kept(by_messages, "a", "resp_0", messages=2)
    kept(by_messages, "a", "resp_1", messages=4)
    assert by_messages.get("a", "resp_0") is None and by_messages.get("a", "resp_1") is not None


def test_a_deleted_response_is_gone_and_frees_its_share():
    store = ResponseStore(max_messages=6)
    kept(store, "a", "resp_0", messages=2)
    assert not store.delete("b", "resp_0"), "another key's delete finds nothing"
    assert store.delete("a", "resp_0") and store.get("a", "resp_0") is None
    assert not store.delete("a", "resp_0")
    kept(store, "a", "resp_1", messages=2)
    kept(store, "a", "resp_2", messages=2)
    assert store.get("a", "resp_1") is not None, "the deleted response no longer counts"
