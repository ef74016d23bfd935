"""The gateway's view of the cache: what it sends, what it keeps from the replies, fork and release."""

from dataclasses import replace

import grpc
import pytest

from cache_service import messages
from cache_service.allocators import registry
from cache_service.hybrid_blocks import HybridBlocks
from common.kv_groups import group_layers
from gateway.kv_view import KVView
from gateway.sequence import Sampling, Sequence, Status
from protos import cache_pb2
from tests.fake_cache import FakeCache

BS = 4
GREEDY = Sampling(max_tokens=8, temperature=0.0, top_p=1.0, top_k=0, seed=None, ignore_eos=False,
                  stop_token_ids=frozenset())  # fmt: skip


def seq(name: str, prompt_len: int, sampling: Sampling = GREEDY) -> Sequence:
    return Sequence(seq_id=name, prompt_ids=list(range(prompt_len)), sampling=sampling, max_len=64)


class Gone(grpc.RpcError):
    def details(self) -> str:
        return "the cache service is gone"


class Recording(FakeCache):
    """Keeps every request; Reserve reports `hits` cached tokens for new sequences; Free can fail."""

    def __init__(self, num_blocks: int, hits: int = 0, free_fails: bool = False) -> None:
        super().__init__(num_blocks, BS)
        self.requests, self.hits, self.free_fails = [], hits, free_fails

    def Reserve(self, request, **kw):
        self.requests.append(request)
        reply = super().Reserve(request, **kw)
        for table in reply.tables[: len(request.new_seqs)]:
            table.cached_tokens = self.hits
        return reply

    def Free(self, request, **kw):
        if self.free_fails:
            raise Gone()
        return super().Free(request, **kw)


def test_reserve_sends_each_token_once_and_keeps_the_tables_from_their_tails():
    cache = Recording(16)
    kv, a = KVView(cache, BS, 16), seq("a", 6)
    a.chunk_end = 6
    kv.reserve([a])
    assert list(cache.requests[0].new_seqs[0].token_ids) == list(range(6))
    assert kv.holds(a) and len(kv.block_table(a)) == 2 and kv.available_blocks == 14
    a.num_computed, a.output_ids, a.chunk_end = 6, [42], 7
    kv.reserve([a])
    a.num_computed, a.output_ids, a.chunk_end = 7, [42, 43], 8
    kv.reserve([a])
    assert len(cache.requests) == 1, "decodes the table holds send no Reserve"
    a.num_computed, a.output_ids, a.chunk_end = 8, [42, 43, 44], 9
    kv.reserve([a])
    (extend,) = cache.requests[1].running_seqs
    assert (list(extend.token_ids), extend.num_computed, extend.num_tokens) == ([42, 43, 44], 8, 9)
    assert kv.block_table(a) == cache.tables["a"], "the tail (from block 2) joined the table it had"
    assert kv.blocks_needed(a, 13) == 1 and kv.room(a, 1) == 4 * BS - 8


def test_a_prefix_hit_moves_progress_on_and_is_recorded_once():
    kv, a = KVView(Recording(16, hits=4), BS, 16), seq("a", 6)
    a.chunk_end = 6
    kv.reserve([a])
    assert (a.num_computed, a.cached_tokens) == (4, 4) and a.scheduled_at is not None
    assert a.cached_prefix, "compute is told the prefix came from the cache"
    b = seq("b", 6)
    b.chunk_end = 6
    KVView(Recording(16), BS, 16).reserve([b])
    assert not b.cached_prefix


def test_fork_shares_the_table_and_counts_the_copy_of_the_tail():
    kv, parent = KVView(Recording(16), BS, 16), seq("p", 6, sampling=replace(GREEDY, n=3, seed=5))
    parent.chunk_end, parent.status = 6, Status.RUNNING
    kv.reserve([parent])
    assert parent.forks_now
    children = parent.fork()
    kv.fork(parent, children)
    assert [c.seq_id for c in children] == ["p/1", "p/2"] and [c.index for c in children] == [1, 2]
    assert [c.sampling.seed for c in children] == [6, 7] and all(c.num_computed == 5 for c in children)
    assert all(c.outbox is parent.outbox and c.output_ids is not parent.output_ids for c in children)
    assert all(kv.block_table(c) == kv.block_table(parent) for c in children)
    assert kv.blocks_needed(parent, 6) == kv.blocks_needed(children[0], 6) == 1


def test_release_forgets_the_sequences_even_when_free_fails():
    cache = Recording(16, free_fails=True)
    kv, a, b = KVView(cache, BS, 16), seq("a", 6), seq("b", 3)
    a.chunk_end = 6
    kv.reserve([a])
    with pytest.raises(grpc.RpcError):
        kv.free([a])
    assert kv.holds(a), "a failed Free forgets nothing"
    kv.release([a, b])
    assert not kv.holds(a) and a.num_computed == 0
    cache.free_fails = False
    b.chunk_end = 3
    kv.reserve([b])
    kv.release([b])
    assert not kv.holds(b) and kv.available_blocks == 14, "a's blocks were never given back"


def test_reset_takes_the_new_pools_size_once_nothing_is_held():
    kv = KVView(Recording(8), BS, 8)
    a = seq("a", 5)
    a.chunk_end = 5
    kv.reserve([a])
    a.num_computed = 5
    with pytest.raises(AssertionError, match="1 sequences still held"):
        kv.reset(16)
    kv.forget([a])
    assert a.num_computed == 0
    kv.reset(16)
    assert kv.num_blocks == kv.available_blocks == 16 and not kv.holds(a)


def test_a_free_sends_the_tokens_the_cache_does_not_hold_with_the_progress():
    cache = Recording(16)
    kv, a = KVView(cache, BS, 16), seq("a", 6)
    a.chunk_end = 6
    kv.reserve([a])
    a.num_computed, a.output_ids, a.chunk_end = 6, [42], 7
    kv.reserve([a])  # covered: the cache still holds 6 tokens
    a.num_computed = 7
    requests = []
    cache.Free = lambda request, **kw: requests.append(request) or FakeCache.Free(cache, request, **kw)
    kv.free([a])
    assert dict(requests[0].num_computed) == {"a": 7}
    assert {k: list(v.token_ids) for k, v in requests[0].appended_token_ids.items()} == {"a": [42]}


def test_a_fork_or_a_full_block_makes_the_step_reserve_again():
    cache = Recording(16)
    kv, parent = KVView(cache, BS, 16), seq("p", 6, replace(GREEDY, n=2))
    parent.chunk_end = 6
    kv.reserve([parent])
    parent.num_computed = 6
    (child,) = parent.fork()
    kv.fork(parent, [child])
    parent.output_ids, parent.chunk_end, child.chunk_end = [42], 7, 6
    assert not kv.covers([parent]) and not kv.covers([child]), "shared blocks are copied on write"
    kv.reserve([parent, child])
    assert kv.covers([parent])
    parent.chunk_end = 9
    assert not kv.covers([parent]), "a chunk past the table's blocks grows it"


class GroupedCache:
    """Reserve and Free over the cache's hybrid manager (a table per KV group), as the service replies."""

    def __init__(self, windows: list[int], num_blocks: int) -> None:
        groups = group_layers(windows)
        self.blocks = HybridBlocks(registry.create("freelist", num_blocks), groups, BS, prefix_caching=False)

    def Reserve(self, request, **kw):
        new, running = (
            [messages.seq_request(s) for s in part] for part in (request.new_seqs, request.running_seqs)
        )
        tails = self.blocks.reserve(new, running)
        seq_ids = [s.seq_id for s in (*request.new_seqs, *request.running_seqs)]
        return messages.block_tables(seq_ids, tails, self.blocks.num_available)

    def Free(self, request, **kw):
        freed = self.blocks.free(list(request.seq_ids))
        return cache_pb2.FreeResponse(freed_blocks=freed, available_blocks=self.blocks.num_available)


def test_a_view_of_kv_groups_keeps_every_groups_table_and_counts_blocks_per_group():
    cache = GroupedCache([0, 9], 64)
    kv, a = KVView(cache, BS, 64, windows=(0, 9)), seq("a", 40)
    assert kv.num_groups == 2
    a.chunk_end = 20
    assert kv.blocks_needed(a, 20) == 2 * 5, "a block per group for each block the tables lack"
    kv.reserve([a])
    for end in range(24, 41, 4):
        a.num_computed, a.chunk_end = a.chunk_end, end
        kv.reserve([a])
    (full,), (sliding,) = kv.step_tables([a])
    held_full, held_sliding = cache.blocks.block_tables("a")
    assert full == held_full, "each group's tails joined its table"
    # NOTE: the entries the cache released since (before the window of the last step's first query) stay
    # as the view had them: the window masks them, and each step's tail starts after them.
    assert sliding[7:] == held_sliding[7:] and held_sliding[:7] == [cache.blocks.null_block] * 7
    assert kv.held_blocks() == set(full) | set(sliding)
    assert kv.blocks_needed(a, 44) == 2 and kv.room(a, 4) == (10 + 2) * BS - a.chunk_start
    # a sequence's whole context: every full block, the sliding group's window (three blocks) plus one
    assert kv.blocks_to_hold(seq("b", 40), 40) == 10 + 4
    kv.free([a])
    assert kv.available_blocks == 63, "all but the null block"
