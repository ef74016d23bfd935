"""`pagedserve bench --workload embeddings`: embeddings/s at batch 32 through gRPC Embed, one batch at a time,
and the same batches on vLLM's pooling runner (`--peer vllm`).

A pass sends BATCHES requests of BATCH inputs each, input lengths uniform in [MIN_TOKENS, MAX_TOKENS] random
token ids (each pass its own, so that no pass finds another's prefixes cached), after one warm-up batch. The
stack the bench starts pools as the model declares, or by its last token (--pooling last) where the model
declares nothing (docs/embeddings.md).
"""

import random
import statistics
import sys
import time
from datetime import UTC, datetime

from tqdm import tqdm

from cli.bench import vllm_embed_peer
from common.cpu import describe
from common.model_files import local_copy
from sdk.client import Client

NAME = "embeddings"
BATCH, BATCHES = 32, 8
MIN_TOKENS, MAX_TOKENS = 32, 256
DESCRIPTION = (
    f"{BATCHES} requests of {BATCH} inputs, {MIN_TOKENS}-{MAX_TOKENS} tokens each, one request at a time"
)


def batches(seed: int, vocab_size: int, count: int = BATCHES) -> list[list[list[int]]]:
    """`count` batches of BATCH inputs of random token ids (past the special ones at the vocabulary's
    start)."""
    rng = random.Random(seed)

    def one() -> list[int]:
        return [rng.randrange(100, vocab_size) for _ in range(rng.randint(MIN_TOKENS, MAX_TOKENS))]

    return [[one() for _ in range(BATCH)] for _ in range(count)]


def stack_flags(model: str) -> tuple[str, ...]:
    """`up` flags of the bench's stack: --pooling last for a model that declares no pooling."""
    return () if (local_copy(model).path / "modules.json").exists() else ("--pooling", "last")


def figures(seconds: list[float], inputs: list[list[list[int]]]) -> dict:
    """One pass's figures from each batch's seconds."""
    total = sum(seconds)
    tokens = sum(len(ids) for batch in inputs for ids in batch)
    ordered = sorted(seconds)
    return {
        "embeddings_per_s": sum(map(len, inputs)) / total,
        "prompt_tokens_per_s": tokens / total,
        "batch_ms_p50": statistics.median(seconds) * 1e3,
        "batch_ms_p99": ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))] * 1e3,
    }


def median_of(runs: list[dict]) -> dict:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def _passes(target: str, vocab_size: int, seed: int, repeat: int) -> dict:
    runs = []
    with Client(target, timeout=600) as client:
        client.embed(batches(seed, vocab_size, 1)[0])  # warm-up
        for index in tqdm(range(repeat), desc=NAME, file=sys.stderr):
            inputs = batches(seed + 1 + index, vocab_size)
            seconds = []
            for batch in inputs:
                start = time.perf_counter()
                result = client.embed(batch)
                seconds.append(time.perf_counter() - start)
                assert len(result.vectors) == len(batch)
            runs.append(figures(seconds, inputs))
    return median_of(runs)


def run(args, start) -> dict:
    """The workload on a stack `start(*flags)` starts (or on --target), and on vLLM with --peer vllm."""
    stack = None if args.target else start(*stack_flags(args.model))
    target = args.target or stack.target
    try:
        with Client(target) as client:
            info = client.info()
        if not info.pooling:
            raise SystemExit(
                f"pagedserve bench: {info.model} serves no embeddings (start it with --pooling last)"
            )
        result = {
            "workload": NAME,
            "description": DESCRIPTION,
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "machine": describe(),
            "setup": f"{info.model}, {info.dtype}, pooling {info.pooling}, {info.embedding_dimensions} "
            f"dimensions, median of {args.repeat}",
            "pagedserve": _passes(target, info.vocab_size, args.seed, args.repeat),
        }
    finally:
        if stack is not None:
            stack.stop()
    if "vllm" in args.peer:
        _vllm(args, result, info)
    return result


def _vllm(args, result: dict, info) -> None:
    """The same passes' batches on vLLM, its figures and the ratios into `result`; a peer that fails is
    reported there (`peer_error`) and on stderr, the pagedserve figures kept."""
    inputs = [batches(args.seed + 1 + index, info.vocab_size) for index in range(args.repeat)]
    print(f"{NAME}: vLLM peer (it compiles for ~2 minutes at each start)", file=sys.stderr)
    try:
        peer = vllm_embed_peer.measure(args, inputs, args.vllm_dtype or info.dtype)
    except (RuntimeError, ValueError) as error:
        print(f"{NAME}: the vLLM peer failed: {error}", file=sys.stderr)
        result["peer_error"] = {vllm_embed_peer.NAME: str(error)}
        return
    runs = [figures(seconds, batch) for seconds, batch in zip(peer.pop("seconds"), inputs, strict=True)]
    result["peers"] = {vllm_embed_peer.NAME: median_of(runs)}
    result["vllm_setup"] = peer
    result["ratios"] = {
        key: result["pagedserve"][key] / value if "per_s" in key else value / result["pagedserve"][key]
        for key, value in result["peers"][vllm_embed_peer.NAME].items()
    }


def table(result: dict) -> str:
    """The figures as the bench prints them."""
    columns = {"pagedserve": result["pagedserve"], **result.get("peers", {})}
    if "ratios" in result:
        columns["ratio"] = result["ratios"]
    lines = [f"{result['workload']}: {result['description']}", result["setup"]]
    lines.append("figure".ljust(22) + "".join(name.rjust(14) for name in columns))
    for key in result["pagedserve"]:
        lines.append(key.ljust(22) + "".join(f"{column[key]:14.2f}" for column in columns.values()))
    return "\n".join(lines)
