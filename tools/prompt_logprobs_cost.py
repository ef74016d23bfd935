"""What scoring a prompt costs (sampling.prompt_logprobs, completions' echo with logprobs): a prompt of L
tokens sent once to warm the prefix cache, then --repeats times each, alternated (a shared machine's load
drifts): plain (one greedy token; its prompt's whole blocks are prefix hits), uncached (the same in a fresh
cache_salt: the whole prompt computed) and scored (with prompt_logprobs: the whole prompt computed, the head
applied at every position). Prints one JSON line per L: the median seconds of each, scored's ratio to each
(to plain: what skipping the cache costs too; to uncached: the scoring alone) and the cached tokens each
reported.

Against a running stack (`pagedserve up --dtype float32`, say):

    PYTHONPATH=$PWD .venv/bin/python tools/prompt_logprobs_cost.py --target 127.0.0.1:50051 \
        --lengths 128 512 2048
"""

import argparse
import json
import statistics
import time
import uuid

from sdk.client import Client

TEXT = "In a small village by the sea, an old fisherman told the children a story every evening. "


KINDS = ("plain", "uncached", "scored")


def timed(client: Client, ids: list[int], kind: str) -> tuple[float, int]:
    """Seconds of one request of that kind and the prompt tokens its usage reports cached."""
    extras = {"plain": {}, "uncached": {"cache_salt": uuid.uuid4().hex}, "scored": {"prompt_logprobs": 1}}
    extra = extras[kind]
    start = time.perf_counter()
    done = client.generate(token_ids=ids, max_tokens=1, temperature=0.0, **extra)
    seconds = time.perf_counter() - start
    assert (kind == "scored") == (done.prompt_logprobs is not None)
    return seconds, done.usage.cached_tokens


def measure(client: Client, length: int, repeats: int) -> dict:
    words = client.tokenize(TEXT).token_ids
    ids = (list(words) * (length // len(words) + 1))[:length]
    timed(client, ids, "plain")
    runs: dict[str, list[tuple[float, int]]] = {kind: [] for kind in KINDS}
    for _ in range(repeats):
        for kind in KINDS:
            runs[kind].append(timed(client, ids, kind))
    seconds = {kind: statistics.median(s for s, _ in runs[kind]) for kind in KINDS}
    return {
        "prompt_tokens": length,
        **{f"{kind}_s": round(seconds[kind], 4) for kind in KINDS},
        "scored_to_plain": round(seconds["scored"] / seconds["plain"], 2),
        "scored_to_uncached": round(seconds["scored"] / seconds["uncached"], 2),
        **{f"{kind}_cached_tokens": runs[kind][-1][1] for kind in KINDS},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="127.0.0.1:50051")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with Client(args.target, timeout=600) as client:
        for length in args.lengths:
            print(json.dumps(measure(client, length, args.repeats)), flush=True)


if __name__ == "__main__":
    main()
