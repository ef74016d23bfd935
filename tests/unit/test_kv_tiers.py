"""The KV tier on a real RocksDB in a temp dir: records, checksums, the LRU budget, the layout fingerprint,
and the tier joined to a real pool (blocks written when evicted or hot, loaded into a new pool after a
restart)."""

import time
from pathlib import Path

import pytest
import torch
from rocksdict import Options, Rdict

from cache_service.kv_pool import KVPool
from cache_service.prefix_cache import block_hash, chain, root_hash
from cache_service.sequence import SeqRequest
from cache_service.tiers import record, registry
from cache_service.tiers.base import KVTier, TierError
from cache_service.tiers.manager import StopFlush, TierManager
from cache_service.tiers.rocksdb import DATA, RocksDBTier
from common.errors import InvalidArgument
from common.kv_groups import group_layers
from common.logging import configure
from common.shared_pool import PoolSpec

LOG = configure("cache", "console", "error")
BLOCK_SIZE = 4
SPEC = PoolSpec(
    num_layers=2, num_blocks=8, block_size=BLOCK_SIZE, num_kv_heads=2, head_dim=4, dtype=torch.float32
)
PROMPT = list(range(10, 30))  # 20 tokens: 5 full blocks, of which 4 can be hits (never the last token's)
# A stop that stores the queued writes only.
QUEUED_ONLY = StopFlush(0, 5.0)


def rec(n: int, size: int = 100) -> bytes:
    return record.encode(bytes([n % 256]) * size)


# the store


def test_rocksdb_stores_loads_and_keeps_records_across_reopening(tmp_path: Path):
    tier = RocksDBTier(str(tmp_path / "db"), 10_000)
    assert (tmp_path / "db").stat().st_mode & 0o777 == 0o700, "the records are other requests' K/V"
    tier.store(b"k1", rec(1))
    assert tier.contains(b"k1") and not tier.contains(b"k2")
    assert tier.load(b"k1") == rec(1) and tier.load(b"k2") is None
    tier.delete(b"k1")
    assert tier.load(b"k1") is None and tier.usage().records == 0
    tier.store(b"k2", rec(2))
    tier.close()
    reopened = RocksDBTier(str(tmp_path / "db"), 10_000)
    assert reopened.load(b"k2") == rec(2)
    assert reopened.usage().bytes == len(rec(2))
    reopened.close()


def test_a_second_process_cannot_open_the_same_directory(tmp_path: Path):
    tier = RocksDBTier(str(tmp_path / "db"), 10_000)
    try:
        with pytest.raises(TierError, match="cannot open the RocksDB tier"):
            RocksDBTier(str(tmp_path / "db"), 10_000)
    finally:
        tier.close()


def test_the_budget_drops_the_least_recently_used_record_also_after_reopening(tmp_path: Path):
    size = len(rec(0))
    tier = RocksDBTier(str(tmp_path / "db"), 3 * size)
    for n in range(3):
        tier.store(b"k%d" % n, rec(n))
    assert tier.load(b"k0") == rec(0)  # k1 is now the least recently used
    tier.store(b"k3", rec(3))
    assert [tier.contains(b"k%d" % n) for n in range(4)] == [True, False, True, True]
    assert tier.usage().evictions == 1 and tier.usage().bytes == 3 * size
    tier.close()
    tier = RocksDBTier(str(tmp_path / "db"), 3 * size)
    tier.store(b"k4", rec(4))  # the order survived: k2 (stored before k0 was used, then k3) goes first
    assert [tier.contains(b"k%d" % n) for n in range(5)] == [True, False, False, True, True]
    tier.close()
    smaller = RocksDBTier(str(tmp_path / "db"), size)
    assert smaller.usage().records == 1 and smaller.contains(b"k4"), "a smaller budget trims at open"
    assert smaller.load(b"x") is None
    smaller.store(b"big", record.encode(b"x" * 2 * size))
    assert not smaller.contains(b"big"), "a record over the budget is not kept"
    smaller.close()


# records


def test_a_record_is_served_only_when_its_length_and_checksum_match():
    payload = bytes(range(200))
    good = record.encode(payload)
    assert record.decode(good, 200) == payload
    flipped = bytearray(good)
    flipped[-1] ^= 1
    for bad, reason in (
        (bytes(flipped), "checksum"),
        (good[:-1], "payload of 199 bytes"),
        (good[:10], "shorter than its header"),
        (b"XXXX" + good[4:], "not a version-1 block record"),
    ):
        with pytest.raises(record.CorruptRecord, match=reason):
            record.decode(bad, 200)
    with pytest.raises(record.CorruptRecord, match="a block takes 100"):
        record.decode(good, 100)


def test_the_fingerprint_and_the_hash_keep_layouts_models_and_salts_apart():
    base = record.fingerprint(SPEC)
    variants = [
        PoolSpec(3, 8, 4, 2, 4, torch.float32),
        PoolSpec(2, 8, 8, 2, 4, torch.float32),
        PoolSpec(2, 8, 4, 1, 4, torch.float32),
        PoolSpec(2, 8, 4, 2, 8, torch.float32),
        PoolSpec(2, 8, 4, 2, 4, torch.bfloat16),
    ]
    fingerprints = {record.fingerprint(spec) for spec in variants}
    assert base not in fingerprints and len(fingerprints) == len(variants)
    assert record.fingerprint(PoolSpec(2, 999, 4, 2, 4, torch.float32)) == base, (
        "the pool's size is not layout"
    )
    tokens = list(range(BLOCK_SIZE))
    keys = {
        record.key(base, block_hash(root_hash(model, salt), tokens))
        for model, salt in (("m", ""), ("m", "tenant-a"), ("m", "tenant-b"), ("other", ""))
    }
    assert len(keys) == 4


def test_tiers_are_chosen_by_name_like_allocators():
    assert registry.available()[:3] == ["none", "redis", "rocksdb"]
    assert registry.resolve("none") is None and registry.resolve("rocksdb") is RocksDBTier
    assert registry.resolve("cache_service.tiers.rocksdb:RocksDBTier") is RocksDBTier
    for name, message in (
        ("redis-ish", "unknown KV tier"),
        ("nowhere.module:Tier", "cannot load KV tier"),
        ("cache_service.tiers.base:TierError", "not a KVTier subclass"),
    ):
        with pytest.raises(InvalidArgument, match=message):
            registry.resolve(name)
    assert issubclass(RocksDBTier, KVTier)


# the tier joined to a pool


@pytest.fixture
def pools():
    """Creates pools (each a shm segment) and releases them all."""
    made = []

    def make(num_blocks: int = 8) -> KVPool:
        pool = KVPool.create(
            PoolSpec(2, num_blocks, BLOCK_SIZE, 2, 4, torch.float32), "model", "freelist", True
        )
        made.append(pool)
        return pool

    yield make
    for pool in made:
        pool.release()


def manager(
    path: Path,
    hot: float = 0.0,
    budget: int = 2**20,
    queue: int = 2**20,
    max_load: int = 256,
    flush: StopFlush = QUEUED_ONLY,
) -> TierManager:
    """A tier manager on RocksDB at path; by default a stop stores only the queued writes."""
    return TierManager(RocksDBTier(str(path), budget), hot, max_load, queue, LOG, flush)


def run(tier: TierManager, pool: KVPool, seq_id: str, prompt=PROMPT, salt: str = "") -> int:
    """Reserve (after the tier loads), write each computed token's K/V (a value from its position and token),
    free; returns the cached tokens."""
    request = SeqRequest(seq_id, len(prompt), prompt, 0, salt)
    tier.load_prefixes(pool.blocks, [request])
    (tail,) = pool.blocks.reserve([request], [])
    for position in range(tail.cached_tokens, len(prompt)):
        block, slot = tail.block_ids[position // BLOCK_SIZE], position % BLOCK_SIZE
        pool.tensor[:, :, block, slot] = float(position * 1000 + prompt[position])
    pool.blocks.free([seq_id], {seq_id: len(prompt)})
    pool.blocks.check_invariants()
    return tail.cached_tokens


def block_values(pool: KVPool, prompt=PROMPT) -> list[float]:
    """The K/V of the prompt's full indexed blocks, one value per token (as `run` wrote them)."""
    values, parent = [], root_hash(pool.identity, "")
    for _, hash_ in chain(parent, prompt, BLOCK_SIZE, 0, len(prompt) // BLOCK_SIZE):
        block = pool.blocks.block_pool.prefix.lookup(hash_)
        values += [float(pool.tensor[1, 1, block, slot, 1, 3]) for slot in range(BLOCK_SIZE)]
    return values


def drained(tier: TierManager) -> TierManager:
    tier.close()  # stores the queued writes
    return tier


def test_blocks_written_once_cached_are_loaded_into_a_new_pool(tmp_path: Path, pools):
    first = pools()
    tier = manager(tmp_path / "db")
    tier.attach(first)
    assert run(tier, first, "a") == 0
    drained(tier)
    assert tier.stats().written_blocks == 5 and tier.stats().stored_blocks == 5
    expected = block_values(first)
    restarted, tier = pools(), manager(tmp_path / "db")
    tier.attach(restarted)
    assert run(tier, restarted, "b") == 4 * BLOCK_SIZE, "all full blocks but the last token's"
    stats = tier.stats()
    assert (stats.hit_blocks, stats.miss_blocks, stats.corrupt_records) == (4, 0, 0)
    assert stats.loaded_bytes == 4 * restarted.spec.block_bytes and stats.load_seconds > 0
    assert block_values(restarted) == expected, "the loaded K/V is the computed K/V"
    assert run(tier, restarted, "c", salt="other tenant") == 0, "another salt finds nothing"
    drained(tier)


def test_a_corrupt_record_is_skipped_counted_and_deleted_never_served(tmp_path: Path, pools):
    first, tier = pools(), manager(tmp_path / "db")
    tier.attach(first)
    run(tier, first, "a")
    drained(tier)
    third_block = next(h for i, h in chain(root_hash(first.identity, ""), PROMPT, BLOCK_SIZE, 0, 3) if i == 2)
    key = DATA + record.key(record.fingerprint(first.spec), third_block)
    db = Rdict(str(tmp_path / "db"), Options(raw_mode=True))
    corrupted = bytearray(db[key])
    corrupted[-5] ^= 0xFF
    db[key] = bytes(corrupted)
    db.close()
    restarted, tier = pools(), manager(tmp_path / "db")
    tier.attach(restarted)
    assert run(tier, restarted, "b") == 2 * BLOCK_SIZE, "the chain stops at the corrupt block"
    stats = tier.stats()
    assert (stats.hit_blocks, stats.corrupt_records) == (2, 1)
    assert block_values(restarted) == block_values(first)
    drained(tier)
    stats = tier.stats()
    assert (stats.written_blocks, stats.stored_blocks) == (1, 5), (
        "the recomputed block replaces the corrupt one"
    )


def test_hot_blocks_are_written_when_hits_reach_the_threshold_and_evicted_ones_always(tmp_path: Path, pools):
    pool, tier = pools(8), manager(tmp_path / "db", hot=0.5)
    tier.attach(pool)
    run(tier, pool, "a")
    assert tier.stats().queued_blocks + tier.stats().written_blocks == 0, "cached, not hot: not written"
    other = list(range(100, 109))  # 2 full blocks
    run(tier, pool, "b", other)  # a lookup that does not hit PROMPT's blocks: 0 of 1
    # 1 hit in 2 lookups since cached: 0.5 >= 0.5, the 4 shared blocks are hot (+3 tokens of a partial hit)
    assert run(tier, pool, "c") == 19
    time.sleep(0.5)
    assert tier.stats().written_blocks == 4
    run(tier, pool, "d", list(range(200, 221)))  # needs 6 blocks: evicts cached ones, written on the way out
    drained(tier)
    stats = tier.stats()
    assert stats.written_blocks > 4 and stats.write_drops == 0 and stats.errors == 0


def test_a_full_write_queue_drops_and_counts(tmp_path: Path, pools):
    pool, tier = pools(), manager(tmp_path / "db", queue=SPEC.block_bytes)  # one block
    tier.attach(pool)
    tier.tier.store = lambda key, data: time.sleep(0.2)  # a slow disk: the queue fills
    run(tier, pool, "a")
    stats = tier.stats()
    assert stats.write_drops >= 3 and stats.write_drops + stats.queued_blocks + stats.written_blocks <= 5
    drained(tier)


def test_loading_is_bounded_per_reserve_and_uses_free_blocks_only(tmp_path: Path, pools):
    first, tier = pools(), manager(tmp_path / "db")
    tier.attach(first)
    run(tier, first, "a")
    drained(tier)
    restarted, tier = pools(), manager(tmp_path / "db", max_load=3)
    tier.attach(restarted)
    assert run(tier, restarted, "b") == 3 * BLOCK_SIZE
    assert tier.stats().skipped_blocks == 1
    drained(tier)


def test_an_invalid_reserve_loads_nothing(tmp_path: Path, pools):
    first, tier = pools(), manager(tmp_path / "db")
    tier.attach(first)
    run(tier, first, "a")
    drained(tier)
    restarted, tier = pools(), manager(tmp_path / "db")
    tier.attach(restarted)
    bad = SeqRequest("b", len(PROMPT) + 1, PROMPT)  # token count disagrees with the tokens
    with pytest.raises(InvalidArgument):
        tier.load_prefixes(restarted.blocks, [bad])
    assert restarted.blocks.stats().free_blocks == 8 and tier.stats().hit_blocks == 0
    drained(tier)


# a planned stop


OTHER = list(range(40, 53))  # 13 tokens: 3 full blocks


def stored(path: Path, pool: KVPool, prompt) -> list[bool]:
    """Which full blocks of `prompt` the (closed) tier at path holds."""
    tier = RocksDBTier(str(path), 2**20)
    try:
        hashes = chain(root_hash(pool.identity, ""), prompt, BLOCK_SIZE, 0, len(prompt) // BLOCK_SIZE)
        return [tier.contains(record.key(record.fingerprint(pool.spec), h)) for _, h in hashes]
    finally:
        tier.close()


def test_a_stop_writes_the_cached_blocks_never_hot_and_a_new_pool_loads_them(tmp_path: Path, pools):
    first, tier = pools(16), manager(tmp_path / "db", hot=1.0, flush=StopFlush(2**20, 5.0))
    tier.attach(first)
    run(tier, first, "a")
    run(tier, first, "b", OTHER)  # not one hit: nothing is hot
    assert tier.stats().written_blocks + tier.stats().queued_blocks == 0
    tier.close()
    assert tier.stats().written_blocks == 8 and stored(tmp_path / "db", first, PROMPT) == [True] * 5
    restarted, tier = pools(), manager(tmp_path / "db")
    tier.attach(restarted)
    assert run(tier, restarted, "c") == 4 * BLOCK_SIZE
    assert block_values(restarted) == block_values(first), "the flushed K/V is the computed K/V"
    drained(tier)


def test_a_stop_writes_the_most_recently_used_blocks_first_within_its_bytes(tmp_path: Path, pools):
    pool = pools(16)
    tier = manager(tmp_path / "db", hot=1.0, flush=StopFlush(3 * pool.spec.block_bytes, 5.0))
    tier.attach(pool)
    run(tier, pool, "a")
    run(tier, pool, "b", OTHER)  # the last released: most recently used
    tier.close()
    assert tier.stats().written_blocks == 3
    assert stored(tmp_path / "db", pool, OTHER) == [True] * 3
    assert stored(tmp_path / "db", pool, PROMPT) == [False] * 5


def test_a_stop_writes_blocks_in_use_before_released_ones_and_keeps_to_its_time(tmp_path: Path, pools):
    pool = pools(16)
    tier = manager(tmp_path / "db", hot=1.0, flush=StopFlush(2**20, 0.5))
    tier.attach(pool)
    run(tier, pool, "a")
    held = SeqRequest("held", len(OTHER), OTHER)
    pool.blocks.reserve([held], [])
    pool.blocks.index_written({"held": len(OTHER)})  # in use, written, indexed
    store = tier.tier.store
    tier.tier.store = lambda key, data: (time.sleep(0.2), store(key, data))  # a slow disk
    started = time.monotonic()
    tier.close()
    assert time.monotonic() - started < 1.0, "the flush keeps to its timeout"
    written = tier.stats().written_blocks
    assert 1 <= written <= 3 and stored(tmp_path / "db", pool, OTHER)[:written] == [True] * written
    assert stored(tmp_path / "db", pool, PROMPT) == [False] * 5
    pool.blocks.free(["held"])


def test_a_pool_of_kv_groups_loads_each_groups_prefix_and_a_sliding_one_only_its_window(tmp_path: Path):
    # layer 0 attends to every key, layer 1 to its last 5: two groups of one layer slot each
    groups = group_layers([0, 5])
    spec = PoolSpec(1, 32, BLOCK_SIZE, 2, 4, torch.float32)
    first = KVPool.create(spec, "model", "freelist", True, groups=groups)
    tier = manager(tmp_path / "db")
    tier.attach(first)
    request = SeqRequest("a", len(PROMPT), PROMPT)
    tier.load_prefixes(first.blocks, [request])
    tails = first.blocks.reserve([request], [])
    for group, (tail,) in enumerate(tails):
        for position in range(len(PROMPT)):
            block, slot = tail.block_ids[position // BLOCK_SIZE], position % BLOCK_SIZE
            first.tensor[:, :, block, slot] = float(group * 10_000 + position * 100 + PROMPT[position])
    first.blocks.free(["a"], {"a": len(PROMPT)})
    drained(tier)
    assert tier.stats().stored_blocks == 2 * 5
    first.release()
    restarted, tier = KVPool.create(spec, "model", "freelist", True, groups=groups), manager(tmp_path / "db")
    try:
        tier.attach(restarted)
        again = SeqRequest("b", len(PROMPT), PROMPT)
        tier.load_prefixes(restarted.blocks, [again])
        # the full group's four blocks before the last token's; token 16's window (12..16) reads block 3
        assert tier.stats().hit_blocks == 4 + 1
        tails, tables = restarted.blocks.reserve([again], []), {}
        for group, (tail,) in enumerate(tails):
            tables[group] = tail.block_ids
            assert tail.cached_tokens == 16
        assert tables[1][:3] == [restarted.blocks.null_block] * 3
        for group, start in ((0, 0), (1, 12)):
            for position in range(start, 16):
                block, slot = tables[group][position // BLOCK_SIZE], position % BLOCK_SIZE
                expected = group * 10_000 + position * 100 + PROMPT[position]
                assert float(restarted.tensor[0, 1, block, slot, 1, 3]) == expected, (group, position)
        restarted.blocks.check_invariants()
        drained(tier)
    finally:
        restarted.release()
