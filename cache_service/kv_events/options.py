"""The KV event flags (cache service, forwarded by `pagedserve up`): vLLM's --kv-events-config as flags."""

import argparse
from dataclasses import dataclass

SCHEMES = ("tcp", "ipc", "inproc")
# Batches kept for replay: vLLM's default (buffer_steps).
REPLAY_BATCHES = 10_000


@dataclass(frozen=True)
class EventsConfig:
    endpoint: str
    topic: str = ""
    replay_endpoint: str | None = None


def endpoint(text: str) -> str | None:
    """A ZMQ endpoint flag: tcp://HOST:PORT, ipc://PATH or inproc://NAME; empty is off (so that compose can
    pass an unset variable)."""
    if not text:
        return None
    scheme, separator, address = text.partition("://")
    if scheme not in SCHEMES or not separator or not address:
        raise argparse.ArgumentTypeError(f"{text!r} is no ZMQ endpoint: give tcp://HOST:PORT or ipc://PATH")
    return text


def add_kv_events(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-events-endpoint",
        type=endpoint,
        help="publish the prefix cache's block stored/removed/cleared events in vLLM's KVEventBatch format "
        "on a ZMQ PUB socket: tcp://*:5557 or ipc://PATH binds, tcp://HOST:PORT connects to a subscriber "
        "that binds (vLLM's rule); off by default (or empty)",
    )
    parser.add_argument(
        "--kv-events-topic", default="", help="every message's first frame (llm-d reads kv@POD@MODEL)"
    )
    parser.add_argument(
        "--kv-events-replay-endpoint",
        type=endpoint,
        help=f"a ZMQ ROUTER, bound here, that sends again the last {REPLAY_BATCHES:,} batches from a "
        "sequence number on",
    )


def events_config(args: argparse.Namespace) -> EventsConfig | None:
    """The publisher's configuration, None when events are off; ValueError for a replay endpoint or topic
    without an endpoint."""
    if args.kv_events_endpoint is None:
        if args.kv_events_replay_endpoint or args.kv_events_topic:
            raise ValueError("--kv-events-topic and --kv-events-replay-endpoint need --kv-events-endpoint")
        return None
    return EventsConfig(args.kv_events_endpoint, args.kv_events_topic, args.kv_events_replay_endpoint)
