"""`bench --peer vllm`: the same workload on vLLM's CPU engine, run by vLLM's own interpreter.

The workload goes to `vllm_driver.py` as JSON (token ids, max tokens, arrival times); its per-request traces
come back as JSON and get the same figures as pagedserve's own passes (`driver.timings`).
"""

import json
import os
import signal
import subprocess
import tempfile
from pathlib import Path

from cache_service.options import DEFAULT_KV_MEMORY
from cache_service.units import parse_size
from cli.bench import binding, driver
from cli.bench.workloads import Workload

DRIVER = Path(__file__).with_name("vllm_driver.py")
PROTOCOL = 1
NAME = "vLLM"
PYTHON_ENV = "PAGEDSERVE_VLLM_PYTHON"
# vLLM's start-up compiles for ~3 minutes the first time (cached afterwards); a run that takes longer than
# this is stuck.
TIMEOUT_S = 3600
MIN_MODEL_LEN = 2048
# vLLM's log lines that tell how its worker bound its threads (kept in the bench's JSON).
BINDING_LOG = (
    "OpenMP thread binding",
    "VLLM_CPU_OMP_THREADS_BIND=",
    "reserve_cpu_num=",
    "core ids=",
    "reserved_cpus=",
)


def request_json(
    workload: Workload,
    model_dir: Path,
    dtype: str,
    repeat: int,
    kv_memory: int = DEFAULT_KV_MEMORY,
    dummy_weights: bool = False,
    draft_tokens: int = 0,
) -> dict:
    """The driver's input (protocol 1) for `repeat` passes of the workload on the model in model_dir (its
    config only, random weights of vLLM's own, if dummy_weights), with vLLM's prompt lookup of
    `draft_tokens` tokens a step (0: off)."""
    longest = max(len(r.prompt_ids) + r.max_tokens for r in workload.requests)
    model_len = max(MIN_MODEL_LEN, longest)
    if workload.kv_tokens:
        # NOTE: vLLM refuses to start unless one sequence of max_model_len fits its KV budget.
        model_len = max(longest, min(model_len, workload.kv_tokens))
    return {
        "protocol": PROTOCOL,
        "model": str(model_dir),
        "dtype": dtype,
        "max_model_len": model_len,
        "kv_memory_bytes": kv_memory,
        "kv_tokens": workload.kv_tokens,
        "repeat": repeat,
        "load_format": "dummy" if dummy_weights else "auto",
        "draft_tokens": draft_tokens,
        "requests": [
            {"prompt_ids": r.prompt_ids, "max_tokens": r.max_tokens, "arrival_s": r.arrival_s}
            for r in workload.requests
        ],
    }


def traces(workload: Workload, one_pass: list[dict]) -> list[driver.Trace]:
    """One pass's traces; ValueError unless each request got exactly its max_tokens (ignore_eos)."""
    fields = ("sent", "token_times", "prompt_tokens", "cached_tokens", "completion_tokens")
    result = [driver.Trace(**{key: trace[key] for key in fields}) for trace in one_pass]
    return driver.check_complete(NAME, workload, result)


def figures(workload: Workload, answer: dict) -> dict:
    """The median figures of the driver's passes; the cache-only figures None."""
    if answer.get("protocol") != PROTOCOL:
        raise ValueError(f"the vLLM driver answered protocol {answer.get('protocol')!r}, not {PROTOCOL}")
    if not answer.get("passes"):
        raise ValueError("the vLLM driver answered no passes")
    cache_only = dict.fromkeys(driver.CACHE_ONLY)
    runs = [{**driver.timings(traces(workload, p)), **cache_only} for p in answer["passes"]]
    return driver.median_of(runs)


def run_driver(
    python: str, request: dict, workdir: Path, bind: str = binding.ALL, driver_path: Path = DRIVER
) -> dict:
    """Runs the driver (`driver_path`) under `python` (stdout and stderr to workdir/vllm.log), its threads
    bound as --vllm-bind says, and returns its answer with vLLM's log lines on the binding ("binding_log");
    RuntimeError with the log's tail if it fails. The driver's processes are killed on any way out."""
    log_path, output = workdir / "vllm.log", workdir / "answer.json"
    env = binding.environment(binding.vllm_env(bind))
    with open(log_path, "w") as log:
        # NOTE: -P keeps the driver's folder off sys.path: cli/bench/profile.py would shadow the stdlib's.
        process = subprocess.Popen(
            [python, "-P", str(driver_path), "--output", str(output)], stdin=subprocess.PIPE, stdout=log,
            stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
        try:
            process.communicate(json.dumps(request).encode(), timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired as error:
            raise RuntimeError(f"the vLLM driver ran past {TIMEOUT_S} s:\n{_tail(log_path)}") from error
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    if process.returncode != 0 or not output.exists():
        raise RuntimeError(f"the vLLM driver ({python}) exited with {process.returncode}:\n{_tail(log_path)}")
    lines = log_path.read_text(errors="replace").splitlines()
    bound = [line for line in lines if any(words in line for words in BINDING_LOG)]
    return {**json.loads(output.read_text()), "binding_log": bound}


def _tail(log_path: Path, lines: int = 20) -> str:
    """The log's first error lines (vLLM's root cause comes long before its last lines), then its end."""
    text = log_path.read_text(errors="replace").splitlines()
    errors = [line for line in text[:-lines] if "Error:" in line][:5]
    return "\n".join([*errors, *(["..."] if errors else []), *text[-lines:]])


def add_flags(parser) -> None:
    parser.add_argument(
        "--vllm-python",
        help=f"the interpreter of a venv with vLLM installed (default: ${PYTHON_ENV})",
    )  # fmt: skip
    parser.add_argument(
        "--vllm-dtype", choices=["float32", "bfloat16"],
        help="the dtype vLLM runs in (default: the stack's --dtype); bfloat16 is vLLM's own default on a cpu "
        "with bfloat16 products, the peer of --weights bfloat16",
    )  # fmt: skip
    parser.add_argument(
        "--vllm-bind", type=binding.vllm_bind, default=binding.ALL, metavar="all|auto|CPUS",
        help="vLLM's OpenMP threads: all = bound to every CPU the bench may use, none reserved (default; a "
        "user's tuning); auto = vLLM's default binding (on 2 vCPUs: one core, one reserved); or a CPU list",
    )  # fmt: skip
    parser.add_argument(
        "--vllm-kv-memory", type=parse_size, default=DEFAULT_KV_MEMORY,
        help="vLLM's KV cache size, e.g. 256MiB (default: the cache service's default pool, 256MiB)",
    )  # fmt: skip


def check_flags(args) -> None:
    """SystemExit unless --peer vllm has an interpreter that exists: --vllm-python, else
    $PAGEDSERVE_VLLM_PYTHON (read now and put into args)."""
    if "vllm" not in args.peer:
        return
    args.vllm_python = args.vllm_python or os.environ.get(PYTHON_ENV)
    if not args.vllm_python:
        raise SystemExit(f"pagedserve bench: --peer vllm needs --vllm-python PATH (or ${PYTHON_ENV})")
    if not Path(args.vllm_python).is_file():
        raise SystemExit(f"pagedserve bench: --vllm-python {args.vllm_python}: no such file")


def setup(figures: dict, args, dtype: str) -> str:
    """One line on how the vLLM peer ran."""
    weights = ", random weights (load_format=dummy)" if args.model_shape else ""
    drafts = f", ngram prompt lookup of {args.draft_tokens} tokens" if args.draft_tokens else ""
    return (
        f"{NAME} {figures.get('version')}: AsyncLLM, each token timed as it streams out, {dtype}{weights}, "
        f"{binding.vllm_label(args.vllm_bind)}, KV {args.vllm_kv_memory / 2**20:.0f}MiB, prefix caching on"
        f"{drafts}, median of {args.repeat}"
    )


def settings(figures: dict, args, dtype: str) -> dict:
    """How the vLLM peer ran, for the bench's JSON."""
    return {
        "version": figures.get("version"),
        "api": "AsyncLLM",
        "dtype": dtype,
        "load_format": "dummy" if args.model_shape else "auto",
        "bind": args.vllm_bind,
        "environment": binding.vllm_env(args.vllm_bind),
        "binding_log": figures.get("binding_log", []),
        "kv_cache_memory_bytes": args.vllm_kv_memory,
        "enable_prefix_caching": True,
        "ngram_draft_tokens": args.draft_tokens,
    }


def measure(
    python: str,
    workload: Workload,
    model_dir: Path,
    dtype: str,
    repeat: int,
    kv_memory: int = DEFAULT_KV_MEMORY,
    bind: str = binding.ALL,
    dummy_weights: bool = False,
    draft_tokens: int = 0,
) -> dict:
    """The workload's median figures on vLLM, its version and its log lines on the binding."""
    request = request_json(workload, model_dir, dtype, repeat, kv_memory, dummy_weights, draft_tokens)
    with tempfile.TemporaryDirectory(prefix="pagedserve-bench-vllm-") as workdir:
        answer = run_driver(python, request, Path(workdir), bind)
    version = answer.get("vllm_version")
    return {**figures(workload, answer), "version": version, "binding_log": answer["binding_log"]}
