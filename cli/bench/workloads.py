"""The benchmark workloads: deterministic prompts, output lengths and arrival times."""

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt_ids: list[int]
    max_tokens: int
    # Seconds after the start of the run when the request is sent.
    arrival_s: float = 0.0


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    requests: list[BenchRequest]
    # A KV budget in tokens for the stack the bench starts (block_size divides it into blocks), so that
    # block sizes compare at equal memory; None keeps the default budget.
    kv_tokens: int | None = None
    # Also run it on a stack with the prefix cache off (when the bench starts its own stacks).
    prefix_cache_off_peer: bool = False

    def stack_flags(self, block_size: int) -> tuple[str, ...]:
        return () if self.kv_tokens is None else ("--kv-blocks", str(max(1, self.kv_tokens // block_size)))


def _tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    # Ids past the special tokens at the start of the vocabulary.
    return [rng.randrange(100, vocab_size) for _ in range(n)]


def throughput(rng: random.Random, vocab: int) -> Workload:
    reqs = [BenchRequest(_tokens(rng, 256, vocab), 64) for _ in range(16)]
    return Workload("throughput", "16 requests, 256-token prompts, 64 new tokens, all at once", reqs)


def latency(rng: random.Random, vocab: int) -> Workload:
    return Workload(
        "latency",
        "1 request, 256-token prompt, 128 new tokens",
        [BenchRequest(_tokens(rng, 256, vocab), 128)],
    )


def mixed(rng: random.Random, vocab: int, rate: float = 2.0) -> Workload:
    reqs, clock = [], 0.0
    for _ in range(48):
        length = round(16 * (1024 / 16) ** rng.random())
        reqs.append(BenchRequest(_tokens(rng, length, vocab), rng.randint(16, 128), clock))
        clock += rng.expovariate(rate)
    return Workload(
        "mixed", f"48 requests, prompts log-uniform in [16, 1024], 16-128 new tokens, {rate}/s arrivals", reqs
    )


def shared_prefix(rng: random.Random, vocab: int) -> Workload:
    system = _tokens(rng, 512, vocab)
    reqs = [BenchRequest(system + _tokens(rng, rng.randint(16, 64), vocab), 32) for _ in range(32)]
    return Workload(
        "shared-prefix",
        "32 requests: one 512-token system prompt + 16-64 unique tokens, 32 new",
        reqs,
        prefix_cache_off_peer=True,
    )


def memory(rng: random.Random, vocab: int) -> Workload:
    reqs = [
        BenchRequest(_tokens(rng, round(16 * (1024 / 16) ** rng.random()), vocab), rng.randint(16, 128))
        for _ in range(32)
    ]
    return Workload(
        "memory",
        "32 requests of mixed lengths at once on a 4096-token KV budget",
        reqs,
        kv_tokens=4096,
    )


# 31 blocks of 128 tokens: whole blocks at block sizes 16-128, within one prompt chunk (--max-batched-tokens
# 4096) and one tier load (--kv-tier-max-load 256 blocks of 16).
LONG_PREFIX_TOKENS = 3968


def long_shared_prefix(rng: random.Random, vocab: int, rate: float = 4.0) -> Workload:
    """16 requests on one long system prompt, Poisson arrivals from t = 0: the first computes the prompt (or
    loads it from a KV tier), the later ones find it cached.

    NOTE: at float32 SmolLM2-135M (46,080 bytes of K/V per token) it holds at most 3,968 + 16 x 48 = 4,736
    tokens, which fit the default 256MiB pool (5,825 tokens) at block sizes 16-64.
    """
    system = _tokens(rng, LONG_PREFIX_TOKENS, vocab)
    reqs, clock = [], 0.0
    for _ in range(16):
        reqs.append(BenchRequest(system + _tokens(rng, rng.randint(16, 32), vocab), 16, clock))
        clock += rng.expovariate(rate)
    return Workload(
        "long-shared-prefix",
        f"16 requests: one {LONG_PREFIX_TOKENS}-token system prompt + 16-32 unique tokens, 16 new, "
        f"{rate}/s arrivals",
        reqs,
    )


WORKLOADS = {
    "throughput": throughput,
    "mixed": mixed,
    "latency": latency,
    "shared-prefix": shared_prefix,
    "memory": memory,
    "long-shared-prefix": long_shared_prefix,
}


def build(name: str, vocab_size: int, seed: int = 0) -> Workload:
    return WORKLOADS[name](random.Random(seed), vocab_size)
