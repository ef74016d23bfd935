"""The gateway's engine over the fake peers (tests/fake_peers.py), for the engine's unit tests: a fixture that
starts engines (stopped at teardown), and request helpers."""

import threading

import pytest
from transformers import AutoTokenizer

from common.model_files import local_copy
from gateway.config import EngineConfig
from gateway.engine import Engine
from gateway.lease import Lease
from gateway.sequence import Sampling, Sequence
from tests.fake_peers import FakeCompute, FakePoolCache

CACHE, COMPUTE, PREFILL = "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"
BLOCKS = 64
GREEDY = Sampling(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 19)), list(range(20, 33))]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(local_copy("smollm2").path)


@pytest.fixture
def start(tokenizer):
    engines = []

    def start(
        grace: float = 30.0, prefill: FakeCompute | None = None, **settings
    ) -> tuple[Engine, FakePoolCache, FakeCompute]:
        """An engine on fake peers; with `prefill`, a prefill compute beside the compute (sharing its K/V)."""
        # NOTE: 8 decode steps a call unless a test says otherwise: the fault tests count compute calls.
        settings = {"decode_steps": 8, **settings}
        if prefill is not None:
            settings["prefill_target"] = PREFILL
        config = EngineConfig(CACHE, COMPUTE, block_size=4, max_batched_tokens=16, max_seqs=8,
                              peer_restart_grace_s=grace, **settings)  # fmt: skip
        engine = Engine(config, tokenizer)
        engine._cache, engine._compute = cache, compute = FakePoolCache(BLOCKS, 4), FakeCompute()
        if prefill is not None:
            engine._prefill, prefill.kv = prefill, compute.kv
        engine.lease = Lease(cache, config.session_ttl_s, engine.session_lost)
        engine.handshake(timeout=1.0, wait=False)
        thread = threading.Thread(target=engine.run, daemon=True)
        thread.start()
        engines.append((engine, thread))
        return engine, cache, compute

    yield start
    for engine, thread in engines:
        engine.stop()
        thread.join(5)
        assert not thread.is_alive(), "the engine loop did not stop"


def submit(engine: Engine, prompt: list[int], request_id: str = "") -> Sequence:
    seq = Sequence(seq_id=f"s{id(prompt)}-{request_id}", prompt_ids=prompt, sampling=GREEDY, max_len=512,
                   request_id=request_id or str(prompt[0]))  # fmt: skip
    engine.submit(seq)
    return seq


def collect(seq: Sequence, timeout: float = 20.0) -> list[int] | Exception:
    tokens = []
    while True:
        item = seq.outbox.get(timeout=timeout)
        if isinstance(item, Exception):
            return item
        tokens += item.token_ids
        if item.finish_reason:
            return tokens


def run_all(engine: Engine) -> list:
    return [collect(seq) for seq in [submit(engine, prompt) for prompt in PROMPTS]]


def assert_nothing_held(engine: Engine, cache: FakePoolCache) -> None:
    assert cache.tables == {} and len(cache.free) == BLOCKS
    assert not engine.scheduler.has_work() and engine.attached_epoch() == cache.epoch
