"""`bench --workload embeddings --peer vllm`: the workload's batches on vLLM's pooling runner, run by vLLM's
own interpreter (vllm_embed_driver.py), bound as --vllm-bind says, its KV cache --vllm-kv-memory."""

import tempfile
from pathlib import Path

from cli.bench import binding, vllm_peer
from common.model_files import local_copy

DRIVER = Path(__file__).with_name("vllm_embed_driver.py")
PROTOCOL = 1
NAME = "vLLM"


def request_json(model_dir: Path, dtype: str, kv_memory: int, passes: list) -> dict:
    """The driver's input; its max_model_len the longest input's (vLLM refuses one beyond the model's)."""
    return {
        "protocol": PROTOCOL,
        "model": str(model_dir),
        "dtype": dtype,
        "max_model_len": max(len(ids) for one_pass in passes for batch in one_pass for ids in batch),
        "kv_memory_bytes": kv_memory,
        "passes": passes,
    }


def measure(args, passes: list[list[list[list[int]]]], dtype: str) -> dict:
    """Each pass's batch seconds ("seconds") and how vLLM ran; RuntimeError or ValueError if it failed."""
    request = request_json(local_copy(args.model).path, dtype, args.vllm_kv_memory, passes)
    with tempfile.TemporaryDirectory(prefix="pagedserve-bench-vllm-embed-") as workdir:
        answer = vllm_peer.run_driver(args.vllm_python, request, Path(workdir), args.vllm_bind, DRIVER)
    if answer.get("protocol") != PROTOCOL or len(answer.get("seconds", ())) != len(passes):
        raise ValueError(f"the vLLM embed driver answered {str(answer)[:200]}")
    return {
        "seconds": answer["seconds"],
        "version": answer.get("vllm_version"),
        "dimensions": answer.get("dimensions"),
        "api": "LLM.embed, runner pooling",
        "dtype": dtype,
        "bind": args.vllm_bind,
        "environment": binding.vllm_env(args.vllm_bind),
        "binding_log": answer["binding_log"],
        "kv_cache_memory_bytes": args.vllm_kv_memory,
    }
