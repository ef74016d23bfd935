"""The RocksDB KV tier with real processes (a tiny random-weight model, services on unix sockets): a long
shared system prompt survives a cache-only restart (the next request's cached_tokens covers it, its output is
the tier-less one), a cache killed with SIGKILL while it writes serves no corrupt block after its restart, and
a record corrupted on purpose is skipped and counted, never served."""

import json
import random
import re
import shutil
import signal
import subprocess
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from rocksdict import Options, Rdict

from cli.scrape import scrape
from sdk.client import Client
from tests.helpers import PAGEDSERVE, free_port, socket_dir, stop
from tests.kv_stack import BLOCK_SIZE, GREEDY, Stack
from tests.processes import segments_of
from tests.tiny_model import save_tiny_llama

pytestmark = pytest.mark.e2e
SYSTEM_TOKENS = 1600  # 100 blocks
rng = random.Random(16)
SYSTEM = [rng.randrange(3, 256) for _ in range(SYSTEM_TOKENS)]
OTHER_SYSTEM = [rng.randrange(3, 256) for _ in range(SYSTEM_TOKENS)]
QUESTIONS = [[rng.randrange(3, 256) for _ in range(20)] for _ in range(3)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tokenizer):
    model = save_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama", max_position_embeddings=4096)
    tokenizer.save_pretrained(model)
    with socket_dir() as sockets:
        svc = Stack(model, sockets, tmp_path_factory.mktemp("logs"))
        try:
            svc.start_cache()
            svc.start_rest(free_port())
            yield svc
        finally:
            codes = {proc.pid: stop(proc) for proc in reversed(svc.procs)}
        assert not any(map(segments_of, [proc.pid for proc in svc.caches])), "a segment was left in /dev/shm"
        killed = {proc.pid for proc in svc.caches if proc.returncode == -signal.SIGKILL}
        assert {code for pid, code in codes.items() if pid not in killed} == {0}, codes


@pytest.fixture(scope="module")
def reference(stack):
    """The outputs of the tier-less cache the stack starts with."""
    assert not stack.tier().name, "no tier yet"
    prompts = [SYSTEM + QUESTIONS[0], SYSTEM + QUESTIONS[1], OTHER_SYSTEM + QUESTIONS[2]]
    results = [stack.generate(prompt) for prompt in prompts]
    assert results[0].usage.cached_tokens == 0
    return {tuple(prompt): result for prompt, result in zip(prompts, results, strict=True)}


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("config") / "pagedserve.yaml"
    storage = path.parent / "kv-tier"
    path.write_text(
        f"persistence:\n  enabled: true\n  storage_path: {storage}\n  hot_blocks_threshold: 0.8\n"
    )
    return path


def test_a_hot_system_prompt_survives_a_cache_restart(stack, reference, config):
    """The hot policy alone: the stop writes only the queued writes (--kv-tier-flush 0; the flush of every
    cached block is test_supervisor.py's)."""
    stack.stop_cache()
    stack.start_cache("--config", str(config), "--kv-tier-flush", "0")
    cold = stack.generate(SYSTEM + QUESTIONS[0])
    assert cold.usage.cached_tokens == 0 and stack.tier().written_blocks == 0, "computed once, not hot yet"
    hit = stack.generate(SYSTEM + QUESTIONS[1])
    assert hit.usage.cached_tokens == SYSTEM_TOKENS, "reused from the pool: now hot (1 hit in 1 lookup)"
    assert hit.token_ids == reference[tuple(SYSTEM + QUESTIONS[1])].token_ids
    stack.stop_cache()  # SIGTERM: queued writes are stored before it exits
    stack.start_cache("--config", str(config), "--kv-tier-flush", "0")
    warm = stack.generate(SYSTEM + QUESTIONS[0])
    stats = stack.tier()
    assert warm.usage.cached_tokens == SYSTEM_TOKENS, "the restarted cache served the prefix from the tier"
    assert warm.token_ids == reference[tuple(SYSTEM + QUESTIONS[0])].token_ids, (
        "identical to the tier-less run"
    )
    assert (stats.hit_blocks, stats.corrupt_records) == (SYSTEM_TOKENS // BLOCK_SIZE, 0)
    ttft = cold.timings.time_to_first_token_s, warm.timings.time_to_first_token_s
    print(
        f"tiny model, {SYSTEM_TOKENS}-token prompt: TTFT cold {ttft[0]:.3f} s, from the tier {ttft[1]:.3f} s"
    )


def test_a_cache_killed_while_writing_serves_no_corrupt_block(stack, reference, config):
    prompt = OTHER_SYSTEM + QUESTIONS[2]
    expected = reference[tuple(prompt)].token_ids
    stack.stop_cache()
    stack.start_cache("--config", str(config), "--kv-tier-hot", "0")  # the flag wins: every block written
    tokens, started = [], threading.Event()

    def consume():
        with Client(stack.gateway_target, timeout=120) as client:
            for chunk in client.stream(token_ids=prompt, **GREEDY):
                tokens.extend(chunk.token_ids)
                started.set()

    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(consume)
        assert started.wait(60)
        stack.stop_cache(signal.SIGKILL)  # the prompt's 100 blocks were just queued for writing
        stack.start_cache("--config", str(config))
        done.result(timeout=120)
    assert tokens == expected, "the stream went on through the restart, unchanged"
    again = stack.generate(prompt)
    assert again.token_ids == expected and again.usage.cached_tokens > 0
    assert stack.tier().corrupt_records == 0


def test_a_corrupted_record_is_skipped_and_counted_never_served(stack, reference, config):
    stack.stop_cache()
    stack.start_cache("--config", str(config), "--kv-tier-hot", "0")
    stack.generate(SYSTEM + QUESTIONS[1])  # the system prompt's blocks are in the tier (loaded or written)
    stack.stop_cache()
    db = Rdict(str(config.parent / "kv-tier"), Options(raw_mode=True))
    corrupted = 0
    for key in list(db.keys()):
        if key.startswith(b"d"):
            record = bytearray(db[key])
            record[-1] ^= 0xFF  # the last payload byte: V of the last token, last head, last layer
            db[key] = bytes(record)
            corrupted += 1
    db.close()
    assert corrupted >= SYSTEM_TOKENS // BLOCK_SIZE
    stack.start_cache("--config", str(config))
    result = stack.generate(SYSTEM + QUESTIONS[1])
    stats = stack.tier()
    assert result.usage.cached_tokens == 0, "the first block's record is corrupt: nothing is loaded"
    assert result.token_ids == reference[tuple(SYSTEM + QUESTIONS[1])].token_ids
    assert stats.corrupt_records == 1 and stats.hit_blocks == 0


def test_the_tier_shows_in_stats_and_metrics(stack, config, tmp_path):
    port = free_port()
    prompt = SYSTEM + QUESTIONS[0]
    loaded = (len(prompt) - 1) // BLOCK_SIZE  # every full block but the last token's: the question's too
    flags = ("--config", str(config), "--kv-tier-path", str(tmp_path / "tier"), "--kv-tier-hot", "0")
    for cached in (0, loaded * BLOCK_SIZE):  # written once cached, then loaded after a restart
        stack.stop_cache()
        stack.start_cache(*flags, "--metrics-port", str(port))
        assert stack.generate(prompt).usage.cached_tokens == cached
    as_json = subprocess.run([*PAGEDSERVE, "stats", "--json", "--cache-target", stack.cache_target],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    tier = json.loads(as_json.stdout)["kv_tier"]
    assert tier["name"] == "rocksdb" and tier["hit_blocks"] == loaded
    table = subprocess.run([*PAGEDSERVE, "stats", "--cache-target", stack.cache_target],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert re.search(rf"^kv_tier\.hit_blocks +{loaded}$", table.stdout, re.M), table.stdout
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
    samples = scrape(f"http://127.0.0.1:{port}/metrics")
    assert samples["pagedserve_kv_tier_hit_blocks_total", ()] == loaded
    assert samples["pagedserve_kv_tier_stored_blocks", ()] >= loaded
    if shutil.which("promtool"):
        check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, timeout=30)
        assert check.returncode == 0, check.stdout + check.stderr
