"""The block manager's invariants, asserted by tests and debugging tools (never on the serving path)."""

from collections.abc import Mapping

from cache_service.block_pool import BlockPool
from cache_service.prefix_cache import block_tokens
from cache_service.sequence import SeqState
from cache_service.stats import Counters


def table_holders(
    seqs: Mapping[str, SeqState],
    counters: Counters,
    block_pool: BlockPool,
    block_size: int,
    null_block: int = -1,
) -> list[int]:
    """Per block, the table entries holding it (entries of null_block, a sliding table's released past, hold
    nothing), once asserted: no table holds a block twice or lacks blocks for its tokens, the counters
    match the tables, indexed blocks hold the tokens of their hash. BlockPool.check_invariants takes them
    (refcount == holders; free + used + cached == total, disjoint)."""
    holders = [0] * block_pool.num_total
    states = seqs.values()
    assert counters.stored_tokens == sum(seq.num_tokens for seq in states), counters
    held = sum(len(seq.block_table) - seq.block_table.count(null_block) for seq in states)
    assert counters.table_blocks == held, counters
    for seq_id, seq in seqs.items():
        seq.check_invariants(seq_id, block_size, null_block)
        for index, block_id in enumerate(seq.block_table):
            if block_id == null_block:
                continue
            holders[block_id] += 1
            if block_pool.prefix.is_indexed(block_id):
                claimed = block_pool.prefix.tokens(block_id)
                assert claimed == tuple(block_tokens(seq.token_ids, index, block_size)), block_id
    return holders
