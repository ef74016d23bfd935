"""`pagedserve monitor --metric NAME`: a live sparkline of one figure, scraped from the services' /metrics."""

import argparse
import sys
import time
import urllib.error
from collections import deque
from collections.abc import Callable

from cli.metrics_ports import metrics_port
from cli.scrape import Samples, scrape

BARS = "▁▂▃▄▅▆▇█"
HISTORY = 60


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


# name → (service whose /metrics holds it, value from that service's samples, is it a ratio in [0, 1])
FIGURES: dict[str, tuple[str, Callable[[Samples], float], bool]] = {
    "cache_usage": ("cache", lambda s: s["pagedserve_kv_cache_usage_ratio", ()], True),
    "used_blocks": ("cache", lambda s: s["pagedserve_kv_blocks", (("state", "used"),)], False),
    "free_blocks": ("cache", lambda s: s["pagedserve_kv_blocks", (("state", "free"),)], False),
    "prefix_hit_rate": (
        "cache",
        lambda s: _ratio(
            s["pagedserve_prefix_cache_hits_total", ()], s["pagedserve_prefix_cache_queries_total", ()]
        ),
        True,
    ),
    "running": ("gateway", lambda s: s["pagedserve_requests_running", ()], False),
    "waiting": ("gateway", lambda s: s["pagedserve_requests_waiting", ()], False),
    "preemptions": ("gateway", lambda s: s["pagedserve_preemptions_total", ()], False),
}


def add_parser(commands) -> None:
    p = commands.add_parser("monitor")
    p.add_argument("--metric", choices=list(FIGURES), default="cache_usage")
    p.add_argument("--host", default="127.0.0.1", help="where the services' /metrics endpoints listen")
    p.add_argument(
        "--metrics-port", type=int, default=9400, help="BASE given to `pagedserve up --metrics-port`"
    )
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.add_argument("--once", action="store_true", help="print every figure's current value and exit")
    p.set_defaults(run=run)


def read(args: argparse.Namespace, names: list[str]) -> dict[str, float]:
    """Current values of the named figures, scraping each service once."""
    scraped: dict[str, Samples] = {}
    values = {}
    for name in names:
        service, value, _ = FIGURES[name]
        if service not in scraped:
            port = metrics_port(args.metrics_port, service)
            scraped[service] = scrape(f"http://{args.host}:{port}/metrics")
        values[name] = value(scraped[service])
    return values


def sparkline(history: deque, top: float) -> str:
    top = top or 1.0
    return "".join(BARS[min(len(BARS) - 1, int(v / top * (len(BARS) - 1) + 0.5))] for v in history)


def _shown(value: float, is_ratio: bool) -> str:
    return f"{value:6.1%}" if is_ratio else f"{value:6g}"


def run(args: argparse.Namespace) -> int:
    try:
        if args.once:
            for name, value in read(args, list(FIGURES)).items():
                print(f"{name:16} {_shown(value, FIGURES[name][2]).strip()}")
            return 0
        return _live(args)
    except (urllib.error.URLError, OSError) as err:
        print(f"error: cannot read metrics ({err}); start the stack with --metrics-port", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print()
        return 0


def _live(args: argparse.Namespace) -> int:
    is_ratio = FIGURES[args.metric][2]
    history: deque[float] = deque(maxlen=HISTORY)
    while True:
        value = read(args, [args.metric])[args.metric]
        history.append(value)
        top = 1.0 if is_ratio else max(history)
        line = f"{args.metric} {_shown(value, is_ratio)} {sparkline(history, top)}"
        sys.stdout.write(f"\r{line:<{HISTORY + 40}}")
        sys.stdout.flush()
        time.sleep(args.interval)
