"""`pagedserve bench --workload soak`: the mixed workload, pass after pass, on a stack whose services are
killed (SIGKILL) at random, one every --kill-every seconds for --duration seconds; `up` restarts them, the
gateway recomputes, the SDK resumes the streams. Reported as JSON: the requests completed and identical to a
fault-free pass, latency around the faults and away from them, each service's memory, what is left at the
end (blocks, sequences, segments)."""

import argparse
import contextlib
import os
import random
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import grpc

from cli.bench import soak_figures as figures
from cli.bench.soak_figures import Fault, Run
from cli.bench.workloads import BenchRequest, mixed
from cli.launch import GATEWAY_SERVICE, Stack
from cli.processes import rss_bytes, services_of
from common.cpu import describe
from common.healthcheck import serving
from common.shm_files import files_of
from sdk.client import Client, GenerationError

NAME = "soak"
SERVICES = ["cache", "compute", "gateway"]
DURATION_S, KILL_EVERY_S = 1800.0, 120.0
# How long a killed service may take to serve again, and the stack to free everything at the end.
RECOVER_S, SETTLE_S = 300.0, 120.0
RSS_EVERY_S = 2.0


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--duration", type=float, help=f"soak: seconds of faults (default {DURATION_S:g})")
    p.add_argument("--kill-every", type=float, help=f"soak: seconds between kills (default {KILL_EVERY_S:g})")
    p.add_argument("--kill", action="append", choices=SERVICES,
                   help="soak: a service to kill (repeatable; default all three)")  # fmt: skip


def check_flags(args: argparse.Namespace) -> None:
    """SystemExit for soak flags given to another workload, or a soak on a stack it does not start."""
    given = [flag for flag, value in (("--duration", args.duration), ("--kill-every", args.kill_every),
                                      ("--kill", args.kill)) if value is not None]  # fmt: skip
    if args.workload != NAME:
        if given:
            raise SystemExit(f"pagedserve bench: {given[0]} is for --workload soak")
        return
    if args.target:
        raise SystemExit("pagedserve bench: the soak kills the services of a stack it starts; drop --target")
    others = {"--peer": args.peer, "--profile": args.profile, "--cold-restart": args.cold_restart}
    for flag, given in others.items():
        if given:
            raise SystemExit(f"pagedserve bench: the soak runs pagedserve alone; drop {flag}")
    if any(value is not None and value <= 0 for value in (args.duration, args.kill_every)):
        raise SystemExit("pagedserve bench: --duration and --kill-every must be > 0")


def sampling(index: int) -> dict:
    """Request `index`'s sampling: greedy for even ones, seeded sampling for odd ones."""
    if index % 2 == 0:
        return {"temperature": 0.0}
    return {"temperature": 0.8, "top_p": 0.95, "seed": 1000 + index}


def run(args: argparse.Namespace, start_stack: Callable[[], Stack]) -> dict:
    """The soak on a stack of start_stack(); its result (the bench's JSON)."""
    duration = DURATION_S if args.duration is None else args.duration
    every = KILL_EVERY_S if args.kill_every is None else args.kill_every
    stack = start_stack()
    # Every cache process of the soak (each kill starts another): their /dev/shm files are checked.
    caches = {services_of(stack.proc.pid)["cache"]}
    try:
        with Client(stack.target) as client:
            info = client.info()
        workload = mixed(random.Random(args.seed), info.vocab_size)
        rss = _Memory(stack)
        with Client(stack.target, timeout=2 * RECOVER_S, resume_timeout=RECOVER_S) as client:
            print(f"soak: a fault-free pass of {len(workload.requests)} requests", file=sys.stderr)
            clean = _pass(client, workload.requests)
            failed = [r for r in clean if r.error]
            if failed:
                raise SystemExit(f"pagedserve bench: the fault-free pass failed: {failed[0].error}")
            reference = {r.index: r.token_ids for r in clean}
            rss.start()
            schedule = figures.kill_schedule(random.Random(args.seed), args.kill or SERVICES, duration, every)
            killer = _Killer(stack, schedule, caches)
            runs = _soak(client, workload.requests, duration, killer)
            rss.stop()
        end = _settle(stack, caches)
    finally:
        stack.stop()
    end["left_after_stop"] = sum(len(files_of(pid)) for pid in caches)
    return {
        "workload": NAME,
        "description": f"the mixed workload ({workload.description}) pass after pass for {duration:g} s, a "
        f"random service of {', '.join(args.kill or SERVICES)} killed every {every:g} s",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": describe(),
        "setup": f"{info.model}, {info.dtype}, KV {info.kv_dtype}, block size {info.block_size}, "
        "half the requests greedy, half seeded sampling",
        "duration_s": duration,
        "kill_every_s": every,
        "requests": figures.outcomes(runs, reference),
        "faults": figures.fault_figures(killer.faults, runs, killer.started),
        "latency": {
            "fault_free_pass": figures.latency(clean),
            "around_faults": figures.latency([r for r in runs if figures.around(r, killer.faults)]),
            "away_from_faults": figures.latency([r for r in runs if not figures.around(r, killer.faults)]),
        },
        "memory": figures.memory(rss.samples),
        "end": end,
    }


def _send(client: Client, request: BenchRequest, index: int, start: float, salt: str) -> Run:
    time.sleep(max(0.0, start + request.arrival_s - time.perf_counter()))
    run = Run(index, sent=time.perf_counter())
    try:
        for chunk in client.stream(token_ids=request.prompt_ids, max_tokens=request.max_tokens,
                                   ignore_eos=True, cache_salt=salt, **sampling(index)):  # fmt: skip
            now = time.perf_counter()
            run.token_ids.extend(chunk.token_ids)
            run.token_times.extend([now] * len(chunk.token_ids))
            run.resumes = chunk.resumes
    except GenerationError as err:
        run.error = err.code.name
    run.ended = time.perf_counter()
    return run


def _pass(client: Client, requests: list[BenchRequest]) -> list[Run]:
    """One pass of the workload, its own cache salt (so each pass computes its prompts)."""
    salt, start = uuid.uuid4().hex, time.perf_counter()
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda i: _send(client, requests[i], i, start, salt), range(len(requests))))


def _soak(client: Client, requests: list[BenchRequest], duration: float, killer: "_Killer") -> list[Run]:
    """Passes while the killer kills, until `duration` has passed; every pass's runs."""
    runs: list[Run] = []
    killer.start()
    try:
        while time.perf_counter() - killer.started < duration:
            runs += _pass(client, requests)
            done, kills = sum(r.error is None for r in runs), len(killer.faults)
            print(f"soak: {len(runs)} requests, {done} completed, {kills} kills", file=sys.stderr)
    finally:
        killer.stop()
    return runs


class _Killer(threading.Thread):
    """Kills the scheduled services of the stack (SIGKILL) and waits, after each, until the stack serves."""

    def __init__(self, stack: Stack, schedule: list, caches: set[int]) -> None:
        super().__init__(daemon=True)
        self.stack, self.schedule, self.caches = stack, schedule, caches
        self.faults: list[Fault] = []
        self.started = 0.0
        self._done = threading.Event()

    def start(self) -> None:
        self.started = time.perf_counter()
        super().start()

    def stop(self) -> None:
        self._done.set()
        self.join()

    def run(self) -> None:
        for at, service in self.schedule:
            if self._done.wait(max(0.0, self.started + at - time.perf_counter())):
                return
            pid = services_of(self.stack.proc.pid).get(service)
            if pid is None:  # NOTE: up is starting it again (it died by itself): the next kill goes on
                continue
            fault = Fault(service, pid, time.perf_counter())
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            self.faults.append(fault)
            fault.back = self._serving_again(fault)
            back = "not back" if fault.back is None else f"back after {fault.back - fault.at:.1f} s"
            print(f"soak: killed {service} (pid {pid}); {back}", file=sys.stderr)

    def _serving_again(self, fault: Fault) -> float | None:
        """When a new process of the killed service and the gateway both answer SERVING."""
        own = {"cache": self.stack.cache_target, "compute": self.stack.compute_target}.get(fault.service)
        deadline = fault.at + RECOVER_S
        while time.perf_counter() < deadline and not self._done.is_set():
            pid = services_of(self.stack.proc.pid).get(fault.service)
            restarted = pid not in (None, fault.pid) and (own is None or serving(own))
            if restarted and serving(self.stack.target, GATEWAY_SERVICE):
                if fault.service == "cache":
                    self.caches.add(pid)
                return time.perf_counter()
            time.sleep(0.1)
        return None


class _Memory(threading.Thread):
    """Samples each service's RSS every RSS_EVERY_S seconds: (pid, bytes) per service, in order."""

    def __init__(self, stack: Stack) -> None:
        super().__init__(daemon=True)
        self.stack = stack
        self.samples: dict[str, list[tuple[int, int]]] = {name: [] for name in SERVICES}
        self._done = threading.Event()

    def sample(self) -> None:
        for name, pid in services_of(self.stack.proc.pid).items():
            if (size := rss_bytes(pid)) is not None:
                self.samples.setdefault(name, []).append((pid, size))

    def run(self) -> None:
        self.sample()
        while not self._done.wait(RSS_EVERY_S):
            self.sample()

    def stop(self) -> None:
        self._done.set()
        self.join()
        self.sample()


def _settle(stack: Stack, caches: set[int]) -> dict:
    """Once the stack has freed what the soak's requests held (a killed gateway's session lapses), or
    SETTLE_S passed: the cache's blocks and sequences, and the /dev/shm files of the live cache and of the
    killed ones (none should be left)."""
    deadline, stats = time.monotonic() + SETTLE_S, None
    while time.monotonic() < deadline:
        with contextlib.suppress(grpc.RpcError):  # NOTE: a cache coming back answers UNAVAILABLE a while
            stats = stack.stats()
        if stats is not None and not (stats.used_blocks or stats.num_sequences):
            break
        time.sleep(0.5)
    if stats is None:
        raise SystemExit(f"pagedserve bench: no answer from the cache within {SETTLE_S:g} s of the end")
    live = services_of(stack.proc.pid).get("cache")
    caches.update({live} if live else ())
    return {
        "used_blocks": stats.used_blocks,
        "num_sequences": stats.num_sequences,
        "cached_blocks": stats.cached_blocks,
        "total_blocks": stats.total_blocks,
        "live_cache_files": len(files_of(live)) if live else 0,
        "stray_files": sum(len(files_of(pid)) for pid in caches if pid != live),
    }
