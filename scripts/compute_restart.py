"""A compute crash, measured: `pagedserve up`, four greedy streams; once each has --after tokens, kill -9 of
the compute service, which `up` restarts. Prints (and writes as JSON) each run's kill-to-next-token time (the
first token any stream gets from the restarted compute, the restart and model load included; split at the
gateway's `attached` event into the restart and what follows it), whether the streams' tokens
are those of a fault-free run, and the steps of the restarted compute holding more than one token per stream
(a prefill of what the streams had; 0 when they go on from the K/V already written). docs/reliability.md
quotes it.

    python -m scripts.compute_restart --runs 3 --json /tmp/compute-restart.json [-- up flags...]
"""

import argparse
import json
import os
import random
import signal
import statistics
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from cli.launch import Stack
from cli.processes import services_of, standby_of

ROOT = Path(__file__).resolve().parent.parent
STREAMS = 4


def streams(
    stack: Stack, prompts: list[list[int]], tokens: int, after: int, fault
) -> tuple[list, list, object]:
    """The prompts streamed at once; once each has `after` tokens, fault() runs. Each stream's tokens, its
    chunks' arrival times, and what fault returned."""
    started = [threading.Event() for _ in prompts]
    arrivals: list[list[float]] = [[] for _ in prompts]

    def consume(i: int) -> list[int]:
        out = []
        with stack.client(timeout=600) as client:
            for chunk in client.stream(
                token_ids=prompts[i], max_tokens=tokens, temperature=0.0, ignore_eos=True
            ):
                out.extend(chunk.token_ids)
                arrivals[i].append(time.time())
                if len(out) >= after:
                    started[i].set()
        return out

    with ThreadPoolExecutor(len(prompts)) as pool:
        running = [pool.submit(consume, i) for i in range(len(prompts))]
        for event in started:
            event.wait(600)
        result = fault()
        outputs = [r.result(timeout=900) for r in running]
    return outputs, arrivals, result


def kill_compute(stack: Stack) -> float:
    """kill -9 of the stack's compute service; when it was sent."""
    pid = services_of(stack.proc.pid)["compute"]
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    return killed_at


def loaded_standby(stack: Stack, timeout: float = 900.0) -> int:
    """The pid of the stack's compute standby once it is loaded and waiting to take over."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = standby_of(stack.proc.pid)
        if found is not None and found[1]:
            return found[0]
        time.sleep(0.2)
    raise TimeoutError(f"no compute standby loaded after {timeout:.0f}s")


def last_attach(log: Path) -> dict:
    """The gateway's last `attached` event in the stack's JSON log, with its wall-clock time."""
    lines = [
        line[line.index("{") :]
        for line in log.read_text(errors="replace").splitlines()
        if '"attached"' in line
    ]
    event = json.loads(lines[-1])
    event["at"] = datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()
    return event


def restarted_compute(stack: Stack) -> dict:
    """The steps the (restarted) compute ran, the tokens they held, and those with more tokens than streams
    (a prefill)."""
    text = urllib.request.urlopen(stack.metrics_url("compute"), timeout=10).read().decode()
    family = next(
        f for f in text_string_to_metric_families(text) if f.name == "pagedserve_forward_step_tokens"
    )
    values = {(s.name, s.labels.get("le")): s.value for s in family.samples}
    count = values[(f"{family.name}_count", None)]
    over = count - values[(f"{family.name}_bucket", f"{float(STREAMS)}")]
    return {
        "steps": int(count),
        "tokens": int(values[(f"{family.name}_sum", None)]),
        "prefill_steps": int(over),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens of each stream")
    parser.add_argument("--after", type=int, default=16, help="tokens each stream has when compute is killed")
    parser.add_argument("--seed", type=int, default=35)
    parser.add_argument("--json", type=Path, help="also write the runs and their median here")
    parser.add_argument("flags", nargs="*", help="more `pagedserve up` flags (after --)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_tokens)] for _ in range(STREAMS)]
    runs = []
    with tempfile.TemporaryDirectory(prefix="compute-restart-") as logs:
        stack = Stack.start("--log-format", "json", *args.flags, log_dir=Path(logs), cwd=ROOT, timeout=900)
        try:
            reference = streams(stack, prompts, args.tokens, args.after, lambda: None)[0]
            for index in range(args.runs):
                standby = None if "--no-compute-standby" in args.flags else loaded_standby(stack)
                outputs, arrivals, killed_at = streams(
                    stack, prompts, args.tokens, args.after, lambda: kill_compute(stack)
                )
                attached = last_attach(stack.proc.log_path)
                # NOTE: the first token the restarted compute computed (one already on its way when compute
                # died may arrive after the kill).
                next_token = min(at for chunks in arrivals for at in chunks if at > attached["at"])
                runs.append(
                    {
                        "kill_to_next_token_s": round(next_token - killed_at, 2),
                        "kill_to_attached_s": round(attached["at"] - killed_at, 2),
                        "attached_to_next_token_s": round(next_token - attached["at"], 2),
                        "kept_running": attached.get("kept_running", 0),
                        "standby_took_over": standby is not None
                        and services_of(stack.proc.pid).get("compute") == standby,
                        "same_tokens": outputs == reference,
                        "restarted_compute": restarted_compute(stack),
                    }
                )
                print(f"run {index + 1}: {json.dumps(runs[-1])}", flush=True)
        finally:
            stack.stop()
    keys = ("kill_to_next_token_s", "kill_to_attached_s", "attached_to_next_token_s")
    medians = {key: statistics.median(run[key] for run in runs) for key in keys}
    print(f"medians over {len(runs)} runs: {json.dumps(medians)}")
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "medians": medians}, indent=1))


if __name__ == "__main__":
    main()
