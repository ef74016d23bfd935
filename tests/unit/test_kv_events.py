"""KV events: vLLM's msgpack layout byte for byte, the events a real block manager's prefix index yields
(chained hashes, parents, tokens, evictions), and the publisher over real ZMQ sockets (bind and connect,
sequence numbers, replay, close), plus the flags' refusals."""

import time

import msgspec
import pytest
import structlog
import zmq

from cache_service.allocators import registry
from cache_service.block_manager import BlockManager
from cache_service.kv_events import wire
from cache_service.kv_events.options import EventsConfig
from cache_service.kv_events.publisher import EventPublisher, binds, from_args
from cache_service.kv_events.recorder import EventRecorder
from cache_service.prefix_cache import block_hash, root_hash
from cache_service.sequence import SeqRequest
from cache_service.server import parse_args
from tests.blocks import allocate, extend
from tests.helpers import free_port, socket_dir
from tests.kv_event_stream import Subscriber, replay

BS = 4
H1, H2 = bytes(range(16)), bytes(range(16, 32))


def test_a_batch_is_an_array_of_tagged_maps_as_vllm_encodes_it():
    batch = wire.KVEventBatch(
        1.5,
        [wire.AllBlocksCleared(), wire.stored(H1, None, [1, 2, 3, 4], BS), wire.removed(H2)],
        0,
    )
    stored = {"type": "BlockStored", "block_hashes": [H1], "parent_block_hash": None,
              "token_ids": [1, 2, 3, 4], "block_size": BS, "lora_id": None, "medium": "GPU",
              "lora_name": None, "group_idx": 0}  # fmt: skip
    removed = {"type": "BlockRemoved", "block_hashes": [H2], "medium": "GPU", "group_idx": 0}
    plain = [1.5, [{"type": "AllBlocksCleared"}, stored, removed], 0]
    assert msgspec.msgpack.encode(batch) == msgspec.msgpack.encode(plain)


def recorded_manager(num_blocks: int) -> tuple[BlockManager, EventRecorder]:
    blocks = BlockManager(registry.create("freelist", num_blocks), BS, model="m")
    recorder = EventRecorder(BS)
    blocks.block_pool.prefix.listeners.append(recorder)
    return blocks, recorder


def written(blocks: BlockManager, seq_id: str, tokens: list[int]) -> None:
    """Admits the sequence, then reports all its tokens written (its full blocks get indexed)."""
    allocate(blocks, [SeqRequest(seq_id, len(tokens), tokens)])
    extend(blocks, [SeqRequest(seq_id, len(tokens), (), num_computed=len(tokens))])


def test_indexed_blocks_are_stored_as_one_chain_and_evicted_ones_removed():
    blocks, recorder = recorded_manager(num_blocks=5)
    tokens = list(range(10))
    written(blocks, "a", tokens)
    h0 = block_hash(root_hash("m", ""), tokens[:4])
    h1 = block_hash(h0, tokens[4:8])
    assert recorder.take() == [wire.BlockStored([h0, h1], None, tokens[:8], BS, None, "GPU", None, 0)]
    assert recorder.wake.is_set()
    written(blocks, "b", tokens[:8] + [50, 51, 52, 53, 54])  # hits a's two blocks, indexes a third
    (event,) = recorder.take()
    assert (event.block_hashes, event.parent_block_hash) == ([block_hash(h1, [50, 51, 52, 53])], h1)
    blocks.free(["a", "b"])
    allocate(blocks, [SeqRequest("c", 5 * BS, list(range(100, 100 + 5 * BS)))])  # takes every block
    removed = recorder.take()
    assert [type(e) for e in removed] == [wire.BlockRemoved]
    assert set(removed[0].block_hashes) == {h0, h1, event.block_hashes[0]}
    assert recorder.take() == [], "taken events are gone"


def test_blocks_of_an_adapter_are_rooted_at_it_and_their_events_name_it():
    blocks, recorder = recorded_manager(num_blocks=8)
    tokens = list(range(8))
    written(blocks, "base", tokens)
    allocate(blocks, [SeqRequest("sql", len(tokens), tokens, lora_id=3, lora_name="sql")])
    assert blocks.cached_tokens("sql") == 0, "the base model's blocks are not the adapter's KV"
    extend(blocks, [SeqRequest("sql", len(tokens), (), num_computed=len(tokens))])
    base, sql = recorder.take()
    assert (base.lora_id, base.lora_name) == (None, None)
    assert (sql.lora_id, sql.lora_name) == (3, "sql")
    assert sql.block_hashes[0] == block_hash(root_hash("m", "", "3:sql"), tokens[:4]) != base.block_hashes[0]


def test_blocks_of_separate_chains_are_separate_events():
    blocks, recorder = recorded_manager(num_blocks=8)
    written(blocks, "a", list(range(8)))
    written(blocks, "b", list(range(20, 28)))
    events = recorder.take()
    assert [e.parent_block_hash for e in events] == [None, None]
    assert [e.token_ids for e in events] == [list(range(8)), list(range(20, 28))]


def publisher_stream(publisher: EventPublisher, blocks: BlockManager, subscriber: Subscriber) -> None:
    """Attaches, records events until the subscriber has one (a subscription takes a moment to reach the
    publisher), then one more chain."""
    publisher.attach(blocks)
    deadline = time.monotonic() + 10
    while not subscriber.messages():
        assert time.monotonic() < deadline, "the subscriber got nothing"
        publisher.recorder.cleared()
        time.sleep(0.1)
    written(blocks, "a", list(range(8)))
    subscriber.wait_quiet(0.5)


def test_a_bound_publisher_numbers_batches_and_replays_them():
    with socket_dir() as sockets:
        config = EventsConfig(f"ipc://{sockets}/ev", "kv@pod@m", f"ipc://{sockets}/replay")
        assert binds(config.endpoint)
        publisher = EventPublisher(config)
        subscriber = Subscriber(config.endpoint, b"kv@pod@m")
        try:
            publisher_stream(publisher, recorded_manager(8)[0], subscriber)
            kept = replay(config.replay_endpoint)
            assert [m.seq for m in kept] == list(range(len(kept)))
            received = subscriber.messages()
            assert received == kept[-len(received) :], "what the subscriber got is the tail of the replay"
            assert kept[0].batch[1][0] == {"type": "AllBlocksCleared"}
            assert kept[-1].batch[1][0]["token_ids"] == list(range(8))
            assert replay(config.replay_endpoint, start=kept[-1].seq) == kept[-1:]
            publisher.close()
            last = subscriber.wait_for(len(received) + 1)[-1]
            assert last.batch[1] == [{"type": "AllBlocksCleared"}], "close clears"
        finally:
            subscriber.close()


def test_a_publisher_connects_to_a_subscriber_that_binds():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    assert not binds(endpoint)
    subscriber = Subscriber(endpoint, bind=True)
    publisher = EventPublisher(EventsConfig(endpoint))
    try:
        publisher_stream(publisher, recorded_manager(8)[0], subscriber)
        last = subscriber.messages()[-1]
        assert last.topic == b"" and last.batch[1][0]["type"] == "BlockStored"
    finally:
        publisher.close()
        subscriber.close()


def test_a_bad_replay_request_is_ignored():
    with socket_dir() as sockets:
        config = EventsConfig(f"ipc://{sockets}/ev", replay_endpoint=f"ipc://{sockets}/replay")
        publisher = EventPublisher(config)
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(config.replay_endpoint)
        try:
            dealer.send_multipart([b"", b"short"])
            assert not dealer.poll(300), "no answer to a malformed request"
            assert replay(config.replay_endpoint) == [], "and the next request is served"
        finally:
            dealer.close()
            publisher.close()


def test_an_endpoint_in_use_is_refused_at_start_up():
    args = parse_args(["--insecure", "--kv-events-endpoint", "inproc://kv-events-taken"])
    first = from_args(args, structlog.get_logger())
    try:
        with pytest.raises(SystemExit) as exit_:
            from_args(args, structlog.get_logger())
        assert "--kv-events-endpoint inproc://kv-events-taken: Address already in use" in str(exit_.value)
    finally:
        first.close()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kv-events-endpoint", "localhost:5557"], "is no ZMQ endpoint"),
        (["--kv-events-replay-endpoint", "ipc:///tmp/replay"], "need --kv-events-endpoint"),
        (["--kv-events-topic", "kv@pod@m"], "need --kv-events-endpoint"),
    ],
)
def test_bad_flags_are_refused(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--insecure", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
