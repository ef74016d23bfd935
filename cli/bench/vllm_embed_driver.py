"""The vLLM peer's driver for the embeddings workload: the same batches on vLLM's pooling runner, each batch
one `LLM.embed` call, timed.

It runs in vLLM's own interpreter (`python -P vllm_embed_driver.py --output RESULT.json < WORKLOAD.json`), so
it imports nothing from pagedserve and nothing but the standard library at module level. Protocol version 1:

- input (stdin): {"protocol": 1, "model": DIR, "dtype": "float32", "max_model_len": N, "kv_memory_bytes": N,
  "enforce_eager": false (optional), "passes": [[[token ids of an input, ...] (a batch), ...] (a pass), ...]}
- output (the file): {"protocol": 1, "vllm_version": V, "dimensions": N, "seconds": [[one per batch], ...]}

The first batch of the first pass is also embedded once before, as a warm-up. vLLM pools as the model
declares (a sentence-transformers modules.json), and by its last token, normalised, for a causal LM
(`convert="embed"`), as pagedserve's bench stack does.
"""

import argparse
import json
import os
import sys
import time

PROTOCOL = 1


def read_workload(text: str) -> dict:
    """The workload from its JSON text; ValueError naming what is wrong with it."""
    workload = json.loads(text)
    if workload.get("protocol") != PROTOCOL:
        raise ValueError(f"protocol {workload.get('protocol')!r}: this driver speaks protocol {PROTOCOL}")
    for key in ("model", "dtype", "max_model_len", "kv_memory_bytes", "passes"):
        if key not in workload:
            raise ValueError(f"the workload has no {key!r}")
    if not workload["passes"] or not all(workload["passes"]):
        raise ValueError("the workload has an empty pass, or none")
    return workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output", required=True)
    args = parser.parse_args()
    workload = read_workload(sys.stdin.read())

    import vllm
    from vllm import LLM

    declared = os.path.exists(os.path.join(workload["model"], "modules.json"))
    llm = LLM(
        model=workload["model"],
        runner="pooling",
        **({} if declared else {"convert": "embed"}),
        dtype=workload["dtype"],
        max_model_len=workload["max_model_len"],
        kv_cache_memory_bytes=workload["kv_memory_bytes"],
        enforce_eager=bool(workload.get("enforce_eager", False)),
        disable_log_stats=True,
    )

    def embed(batch: list[list[int]]) -> list:
        return llm.embed([{"prompt_token_ids": ids} for ids in batch], use_tqdm=False)

    dimensions = len(embed(workload["passes"][0][0])[0].outputs.embedding)
    seconds = []
    for index, one_pass in enumerate(workload["passes"]):
        times = []
        for batch in one_pass:
            start = time.perf_counter()
            outputs = embed(batch)
            times.append(time.perf_counter() - start)
            assert len(outputs) == len(batch)
        seconds.append(times)
        done = f"{index + 1}/{len(workload['passes'])}"
        print(f"vllm embed driver: pass {done} done", file=sys.stderr, flush=True)
    with open(args.output, "w") as f:
        json.dump({"protocol": PROTOCOL, "vllm_version": vllm.__version__, "dimensions": dimensions,
                   "seconds": seconds}, f)  # fmt: skip


if __name__ == "__main__":
    main()
