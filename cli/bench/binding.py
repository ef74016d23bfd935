"""The CPUs the bench may use, and how the peers' threads are bound to them.

vLLM's CPU engine binds its OpenMP threads itself: by default (`VLLM_CPU_OMP_THREADS_BIND=auto`) it picks
cores and reserves one for its other processes, which on a 2-vCPU machine leaves its model one core. The
bench binds it to every CPU it may use, none reserved, as a user tuning it would; `--vllm-bind auto` keeps
vLLM's own choice for comparison, and a CPU list (`0-3`, `0,2,4-7`) binds to those.
"""

import os
import re

ALL = "all"
AUTO = "auto"
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
RESERVED_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"
THREADS_ENV = "OMP_NUM_THREADS"
_CPU_LIST = re.compile(r"^\d+(-\d+)?(,\d+(-\d+)?)*$")


def bench_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity), in order."""
    return sorted(os.sched_getaffinity(0))


def cpu_list(cpus: list[int]) -> str:
    """CPUs as a list of ranges: [0, 1, 2, 5] -> '0-2,5'."""
    parts, start = [], None
    for i, cpu in enumerate(cpus):
        start = cpu if start is None else start
        if i + 1 == len(cpus) or cpus[i + 1] != cpu + 1:
            parts.append(str(cpu) if cpu == start else f"{start}-{cpu}")
            start = None
    return ",".join(parts)


def parse_cpu_list(text: str) -> list[int]:
    """'0-2,5' -> [0, 1, 2, 5]; ValueError unless it is such a list of ascending ranges."""
    if not _CPU_LIST.match(text):
        raise ValueError(f"{text!r} is not a CPU list such as 0-3 or 0,2,4-7")
    cpus = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    if cpus != sorted(set(cpus)):
        raise ValueError(f"{text!r}: the CPUs must ascend without repeats")
    return cpus


def vllm_bind(value: str) -> str:
    """The --vllm-bind argument: all, auto or a CPU list (argparse's type)."""
    if value not in (ALL, AUTO):
        parse_cpu_list(value)
    return value


def vllm_env(bind: str) -> dict[str, str | None]:
    """vLLM's binding variables for --vllm-bind (None: removed from its environment).

    all or a list: its OpenMP threads bound to those CPUs, one thread each, none reserved; auto: vLLM's
    default, none of these variables set."""
    if bind == AUTO:
        return {BIND_ENV: None, RESERVED_ENV: None, THREADS_ENV: None}
    cpus = bench_cpus() if bind == ALL else parse_cpu_list(bind)
    return {BIND_ENV: cpu_list(cpus), RESERVED_ENV: "0", THREADS_ENV: str(len(cpus))}


def environment(overrides: dict[str, str | None]) -> dict[str, str]:
    """This process's environment with the overrides set (or removed where None)."""
    env = {**os.environ, **{k: v for k, v in overrides.items() if v is not None}}
    return {k: v for k, v in env.items() if overrides.get(k, "") is not None}


def vllm_label(bind: str) -> str:
    """How the table header names the binding."""
    env = vllm_env(bind)
    if bind == AUTO:
        return f"vLLM's default binding ({BIND_ENV}=auto, its reserved CPU)"
    settings = " ".join(f"{k}={v}" for k, v in env.items())
    return f"OpenMP threads bound to CPUs {env[BIND_ENV]}, none reserved ({settings})"
