"""What scoring a prompt costs (sampling.prompt_logprobs, completions' echo with logprobs): a prompt of L
tokens sent once to warm the prefix cache, then --repeats times each, alternated (a shared machine's load
drifts): plain (one greedy token; its prompt's whole blocks are prefix hits) and scored (the same, with
prompt_logprobs: the whole prompt computed, the head applied at every position). Prints one JSON line per
L: the median seconds of each, their ratio and the cached tokens each reported.

Against a running stack (`pagedserve up --dtype float32`, say):

    PYTHONPATH=$PWD .venv/bin/python tools/prompt_logprobs_cost.py --target 127.0.0.1:50051 \
        --lengths 128 512 2048
"""

import argparse
import json
import statistics
import time

from sdk.client import Client

TEXT = "In a small village by the sea, an old fisherman told the children a story every evening. "


def timed(client: Client, ids: list[int], scored: bool) -> tuple[float, int]:
    """Seconds of one request and the prompt tokens its usage reports cached."""
    extra = {"prompt_logprobs": 1} if scored else {}
    start = time.perf_counter()
    done = client.generate(token_ids=ids, max_tokens=1, temperature=0.0, **extra)
    seconds = time.perf_counter() - start
    assert (
        scored == (done.prompt_logprobs is not None) and len(done.prompt_logprobs or ids[1:]) == len(ids) - 1
    )
    return seconds, done.usage.cached_tokens


def measure(client: Client, length: int, repeats: int) -> dict:
    words = client.tokenize(TEXT).token_ids
    ids = (list(words) * (length // len(words) + 1))[:length]
    timed(client, ids, scored=False)
    runs: dict[bool, list[tuple[float, int]]] = {False: [], True: []}
    for _ in range(repeats):
        for scored in (False, True):
            runs[scored].append(timed(client, ids, scored))
    plain, scored = (statistics.median(s for s, _ in runs[kind]) for kind in (False, True))
    return {
        "prompt_tokens": length,
        "plain_s": round(plain, 4),
        "scored_s": round(scored, 4),
        "ratio": round(scored / plain, 2),
        "plain_cached_tokens": runs[False][-1][1],
        "scored_cached_tokens": runs[True][-1][1],
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
