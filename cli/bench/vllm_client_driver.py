"""vLLM's benchmark client (`vllm bench serve`, module vllm.benchmarks.serve) driven by the bench: each run
is the command line a user would type, parsed by the client's own `add_cli_args` and run by its `main`.

It runs in vLLM's own interpreter (`python -P vllm_client_driver.py --output RESULT.json < RUNS.json`), so it
imports nothing from pagedserve and nothing but the standard library at module level. Protocol version 1:

- input (stdin): {"protocol": 1, "runs": [[argument, ...], ...]}: each run's arguments of `vllm bench serve`
- output (the file): {"protocol": 1, "vllm_version": V, "results": [{...}, ...]}: per run, the result dict
  the client's `main` returns (the JSON its `--save-result` writes), its per-request lists left out but for
  the first ERRORS of its requests' errors ("first_errors")
"""

import argparse
import json
import sys

PROTOCOL = 1
ERRORS = 3


def read_runs(text: str) -> list[list[str]]:
    """The runs from their JSON text; ValueError naming what is wrong with them."""
    runs = json.loads(text)
    if runs.get("protocol") != PROTOCOL:
        raise ValueError(f"protocol {runs.get('protocol')!r}: this driver speaks protocol {PROTOCOL}")
    if not runs.get("runs"):
        raise ValueError("no runs")
    for i, argv in enumerate(runs["runs"]):
        if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
            raise ValueError(f"run {i} is not a list of arguments")
    return runs["runs"]


def summary(result: dict) -> dict:
    """The client's result without its per-request lists (a value per request: prompts, texts, times), with
    the first ERRORS errors its requests met."""
    kept = {key: value for key, value in result.items() if not isinstance(value, list)}
    return {**kept, "first_errors": [error for error in result.get("errors", []) if error][:ERRORS]}


def main() -> int:
    parser = argparse.ArgumentParser(description="Run vLLM's benchmark client (runs as JSON on stdin).")
    parser.add_argument("--output", required=True, help="where to write the client's results (JSON)")
    args = parser.parse_args()
    try:
        runs = read_runs(sys.stdin.read())
    except ValueError as error:
        print(f"vllm client driver: bad runs: {error}", file=sys.stderr)
        return 2

    import vllm
    from vllm.benchmarks import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    results = []
    for i, argv in enumerate(runs):
        client = FlexibleArgumentParser()
        serve.add_cli_args(client)
        results.append(summary(serve.main(client.parse_args(argv))))
        print(f"vllm client driver: run {i + 1}/{len(runs)} done", file=sys.stderr, flush=True)
    with open(args.output, "w") as out:
        json.dump({"protocol": PROTOCOL, "vllm_version": vllm.__version__, "results": results}, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
